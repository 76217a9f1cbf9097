"""gradreg.integrations.hf_trainer imports without transformers, and names the extra in one line
where PenalizedTrainer is asked for without it."""

from __future__ import annotations

import sys

import pytest

import gradreg.integrations.hf_trainer as hf


def test_a_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # blocked: not importable
    monkeypatch.delitem(vars(hf), "PenalizedTrainer", raising=False)
    with pytest.raises(ImportError, match=r"^gradreg\.integrations\.hf_trainer\.PenalizedTrainer "
                                          r"needs transformers.*pip install "
                                          r"'gradreg\[transformers\]'"):
        hf.PenalizedTrainer  # noqa: B018
    assert hf.PenaltyMixin.__name__ == "PenaltyMixin"  # the mixin needs nothing of it
