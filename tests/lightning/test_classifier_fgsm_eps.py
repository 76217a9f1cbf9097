"""Classifier's attack radius ``fgsm_eps``: a finite number >= 0. A negative one steps down the
loss, so that the "adversarial" accuracy came out above the clean one, a result that looked like
robustness."""

from __future__ import annotations

import math

import pytest

from gradreg.lightning.classifier import Classifier
from gradreg.models import MLP


@pytest.mark.parametrize("eps", [-1, -1e-3, math.nan, math.inf, True, "0.1"])
def test_refused(eps: object) -> None:
    with pytest.raises(ValueError, match=r"fgsm_eps must be a finite number >= 0 \(the L-inf "
                                         rf"radius of the attacks\), got {eps!r}"):
        Classifier(MLP(4, 3, hidden=(5,)), fgsm_eps=eps)


@pytest.mark.parametrize("eps", [0, 0.0, 0.1, 8 / 255])
def test_accepted(eps: float) -> None:
    assert Classifier(MLP(4, 3, hidden=(5,)), fgsm_eps=eps).fgsm_eps == eps
