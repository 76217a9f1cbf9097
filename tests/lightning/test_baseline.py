"""PenaltyBaseline: the unweighted penalty of a run without one, equal to what the penalty itself
computes, with no gradient of its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from gradreg.lightning.callbacks import CustomScalarsLayout, GradientNormMonitor, PenaltyBaseline
from gradreg.penalties import as_points, make_penalty
from tests.lightning.helpers import PlainClassifier, data, events, fit
from tests.lightning.test_dashboards import layout_charts


class Unpenalized(PlainClassifier):
    """The linear classifier without a penalty, its weights fixed (lr = 0)."""

    def __init__(self) -> None:
        super().__init__()
        del self.gp

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self(x), y)


@pytest.mark.parametrize("options", [{}, {"target": 0.5, "power": 1.0}])
def test_the_baseline_is_the_penalty_the_run_would_have_had(options: dict, tmp_path: Path
                                                            ) -> None:
    """lr = 0, one batch: at every logged step the value is the penalty's own unweighted value
    on the batch (its ``last_value``, computed by the penalty with create_graph=True), and the
    weight is logged as 0; also for a target and power of its own."""
    preset = "double_backprop"
    module = Unpenalized()
    baseline = PenaltyBaseline(make_penalty(preset, **options), name=preset, every_n_steps=1)
    run = fit(tmp_path, module, [baseline])
    gp = make_penalty(preset, **options)
    x, y = data()
    x = as_points(x)
    logits = module(x)
    gp(F.cross_entropy(logits, y, reduction="none") if gp.config.of == "loss" else logits, x)
    logged = events(run)
    values = [e.value for e in logged.Scalars(f"penalty/unweighted/penalties.{preset}")]
    assert values == [pytest.approx(float(gp.last_value), rel=1e-6)] * 3
    assert [e.value for e in logged.Scalars(f"penalty/weight/penalties.{preset}")] == [0.0] * 3


def test_the_value_carries_no_gradient() -> None:
    module = Unpenalized()
    value = PenaltyBaseline().value(module, *data())
    assert value.grad_fn is None and not value.requires_grad
    assert all(param.grad is None for param in module.parameters())


def test_a_module_with_a_penalty_logs_its_own_and_no_baseline(tmp_path: Path) -> None:
    run = fit(tmp_path, PlainClassifier(), [PenaltyBaseline(every_n_steps=1)])
    assert not [tag for tag in events(run).Tags()["scalars"] if "double_backprop" in tag]


def test_the_layout_draws_the_baseline_on_the_penaltys_chart(tmp_path: Path) -> None:
    run = fit(tmp_path, Unpenalized(), [CustomScalarsLayout(), GradientNormMonitor(),
                                        PenaltyBaseline(every_n_steps=1)])
    charts = layout_charts(run)
    assert charts["penalty double_backprop, unweighted P"] == [
        r"penalty/unweighted/penalties\.double_backprop$"]
    assert "penalties, weighted: λ·P as added to the loss" not in charts


@pytest.mark.parametrize(("penalty", "message"), [
    ("wgan_gp", "PenaltyBaseline evaluates gradient-norm penalties at a classifier's inputs"),
    ("jacobian", "projection='orthonormal'"),
    ("derivative", "PenaltyBaseline evaluates"),
])
def test_a_penalty_it_cannot_evaluate_is_refused(penalty: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PenaltyBaseline(penalty)
    with pytest.raises(ValueError, match="name the penalty of the baseline"):
        PenaltyBaseline(make_penalty("double_backprop"))
    assert torch.is_grad_enabled()
