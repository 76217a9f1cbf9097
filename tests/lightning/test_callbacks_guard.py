"""AccumulationGuard: the seed-000 bug (``.grad`` accumulates unless reset) caught, and only it.

The model is one weight ``w`` with loss ``w * sum(x)``, so every backward adds exactly
``sum(x) = 1`` to ``w.grad`` (the batch is ones / BATCH) and plain SGD with ``lr = 1`` moves ``w``
by the gradient it applies: the final ``w`` tells which gradients were applied.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader

from gradreg import GradientError, gradient
from gradreg.lightning.callbacks import AccumulationGuard
from gradreg.lightning.callbacks.guard import _nonfinite
from tests.lightning.helpers import trainer

BATCH, STEPS = 4, 4


def ones_loader() -> DataLoader:
    return DataLoader(torch.full((BATCH * STEPS * 2, 1), 1.0 / BATCH), batch_size=BATCH)


class OneWeight(pl.LightningModule):
    """loss = value * w * sum(x): each backward adds value to w.grad; SGD(lr=1) applies it."""

    def __init__(self, value: float = 1.0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.value = value

    def loss(self, x: Tensor) -> Tensor:
        return self.w * x.sum() * self.value

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


class ManualLoop(OneWeight):
    """Manual optimization: zero_grad (or not: the bug), backward, step."""

    def __init__(self, zero_grad: bool = True, set_to_none: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.zero_grad_each_step = zero_grad
        self.set_to_none = set_to_none

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        optimizer = self.optimizers()
        if self.zero_grad_each_step:
            optimizer.zero_grad(set_to_none=self.set_to_none)
        self.manual_backward(self.loss(batch))
        optimizer.step()


def train(tmp_path: Path, module: pl.LightningModule, guard: AccumulationGuard | None,
          **kwargs: object) -> float:
    callbacks = [] if guard is None else [guard]
    options = {"max_steps": STEPS, "logger": False, **kwargs}
    trainer(tmp_path, callbacks, **options).fit(module, ones_loader())
    return module.w.item()


def test_forgotten_zero_grad_in_manual_optimization_is_caught(tmp_path: Path) -> None:
    # Unguarded, the bug applies 1, 2, 3, 4: w = -10 instead of -4.
    assert train(tmp_path, ManualLoop(zero_grad=False), None) == -10.0
    module = ManualLoop(zero_grad=False)
    with pytest.raises(GradientError, match=r"the gradients of w were not reset since the "
                                            r"previous optimizer step"):
        train(tmp_path, module, AccumulationGuard())
    assert module.w.item() == -1.0  # raised before the second step was applied


@pytest.mark.parametrize("set_to_none", [True, False])
def test_correct_manual_loop_is_not_flagged(tmp_path: Path, set_to_none: bool) -> None:
    assert train(tmp_path, ManualLoop(set_to_none=set_to_none), AccumulationGuard()) == -STEPS


def test_accumulate_grad_batches_is_not_flagged(tmp_path: Path) -> None:
    # Two micro-batches per step add 1 + 1, divided by 2 by Lightning: w moves 1 per step.
    guard = AccumulationGuard()
    assert train(tmp_path, OneWeight(), guard, accumulate_grad_batches=2) == -STEPS


def test_automatic_optimization_without_zero_grad_is_caught(tmp_path: Path) -> None:
    class NoZeroGrad(OneWeight):
        def optimizer_zero_grad(self, *args: object) -> None:
            pass

    with pytest.raises(GradientError, match="automatic optimization Lightning does it unless "
                                            "optimizer_zero_grad is overridden"):
        train(tmp_path, NoZeroGrad(), AccumulationGuard())


def test_gradients_of_parameters_inside_training_step_are_not_flagged(tmp_path: Path) -> None:
    # torch.autograd.grad w.r.t. the parameters (a param_grad_norm penalty) runs while .grad
    # still holds the previous step's gradient (Lightning zeroes it just before backward).
    class ParameterGradient(OneWeight):
        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            loss = self.loss(batch)
            (grad,) = gradient(loss, [self.w])
            return loss + 0.0 * grad.square()

    assert train(tmp_path, ParameterGradient(), AccumulationGuard()) == -STEPS


def test_second_optimizers_backward_into_the_first_is_not_flagged(tmp_path: Path) -> None:
    # A GAN: the generator's backward also reaches the critic's weights after the critic stepped;
    # the critic resets them before its next backward, so nothing carries over.
    class Gan(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.critic = nn.Linear(1, 1)
            self.generator = nn.Linear(1, 1)

        def training_step(self, batch: Tensor, batch_idx: int) -> None:
            critic_optimizer, generator_optimizer = self.optimizers()
            critic_optimizer.zero_grad()
            self.manual_backward(self.critic(self.generator(batch).detach()).mean())
            critic_optimizer.step()
            generator_optimizer.zero_grad()
            self.manual_backward(-self.critic(self.generator(batch)).mean())
            generator_optimizer.step()

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return [torch.optim.SGD(self.critic.parameters(), lr=0.1),
                    torch.optim.SGD(self.generator.parameters(), lr=0.1)]

    trainer(tmp_path, [AccumulationGuard()], max_steps=2 * STEPS, logger=False).fit(
        Gan(), ones_loader())


def test_non_finite_gradients_are_caught(tmp_path: Path) -> None:
    with pytest.raises(GradientError, match=r"non-finite gradients \(NaN or Inf\) in w after "
                                            r"backward"):
        train(tmp_path, OneWeight(value=float("inf")), AccumulationGuard())


def test_non_finite_gradients_are_left_to_a_grad_scaler(tmp_path: Path) -> None:
    # fp16 mixed precision: an Inf gradient is the GradScaler's overflow signal; it skips the step.
    scaler = torch.amp.GradScaler("cpu")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    module = OneWeight(value=float("inf"))
    assert train(tmp_path, module, AccumulationGuard(), plugins=[plugin]) == 0.0
    assert scaler.get_scale() == 2.0**16 * 0.5**STEPS  # halved at each skipped step


def test_warn_reports_and_goes_on(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="were not reset since the previous optimizer step"):
        assert train(tmp_path, ManualLoop(zero_grad=False), AccumulationGuard("warn")) == -10.0


def test_skip_drops_the_flagged_step(tmp_path: Path) -> None:
    # Step 1 applies 1; step 2 holds 1 + 1 and is skipped (its gradient dropped); step 3 starts
    # from a fresh gradient and applies 1; step 4 is skipped again: w = -2.
    with pytest.warns(UserWarning, match="action='skip': the gradients were dropped"):
        assert train(tmp_path, ManualLoop(zero_grad=False), AccumulationGuard("skip")) == -2.0


def test_guard_rejects_unknown_action() -> None:
    with pytest.raises(ValueError, match="unknown action 'ignore'; choose 'raise'"):
        AccumulationGuard("ignore")


def test_guard_removes_its_hooks_after_fit(tmp_path: Path) -> None:
    module = ManualLoop(zero_grad=False)
    train(tmp_path, module, AccumulationGuard("warn"), max_steps=1)
    assert not module.w._backward_hooks


def test_nonfinite_gradients_are_found_by_one_reduction() -> None:
    """All parameters' gradients reduced at once (one host read per step on a GPU); the names
    come from per-parameter flags read only when some gradient is not finite."""
    params = [torch.zeros(2, requires_grad=True) for _ in range(3)]
    for param, value in zip(params, (1.0, float("nan"), float("-inf")), strict=True):
        param.grad = torch.tensor([0.5, value])
    assert _nonfinite(params) == params[1:]
    params[1].grad, params[2].grad = torch.ones(2), torch.ones(2)
    assert _nonfinite(params) == [] and _nonfinite([]) == []
