"""A penalty's state dict as earlier releases wrote it (the keys ``step``, ``ema`` and
``_extra_state`` with the weight) loads into the penalties of this one, for every preset."""

from __future__ import annotations

import pytest
import torch

from gradreg.penalties import PRESETS, make_penalty

OPTIONS = {"intermediate": {"layers": ["act1"]}}


def _old_format(step: int, ema: float, weight: float) -> dict:
    """Written out by hand, as the earlier releases saved it (not by this code)."""
    return {"step": torch.tensor(step), "ema": torch.tensor(ema),
            "_extra_state": {"weight": weight}}


@pytest.mark.parametrize("name", list(PRESETS))
def test_an_old_state_dict_loads_with_its_counter_running_mean_and_weight(name: str) -> None:
    penalty = make_penalty(name, every=4, **OPTIONS.get(name, {}))
    result = penalty.load_state_dict(_old_format(step=6, ema=0.25, weight=3.5))
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert penalty.weight == 3.5 and penalty.steps_taken == 6
    assert penalty.ema.item() == 0.25
    # the lazy counter goes on from 6: due on the 9th call (index 8), not on the 7th
    assert [penalty.due() for _ in range(4)] == [False, False, True, False]


def test_a_float64_running_mean_is_restored_in_float64() -> None:
    penalty = make_penalty("path_length")
    state = _old_format(step=1, ema=0.1, weight=2.0)
    state["ema"] = torch.tensor(0.1, dtype=torch.float64)
    penalty.load_state_dict(state)
    assert penalty.ema.dtype == torch.float64 and penalty.ema.item() == 0.1
