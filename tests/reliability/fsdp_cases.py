"""One training step of every case of the FSDP2 parity test, sharded or not (shared by
``fsdp_run.py``, the ranks, and ``test_fsdp.py``, the one-process reference).

The critic ``4 -> 16 -> tanh -> 16 -> tanh -> 3`` is sharded layer by layer and at the root
(the last layer's 3 rows split 2 + 1 over 2 ranks: uneven shards). Rank ``r`` takes batch ``r``;
FSDP averages the ranks' gradients, so the reference is the unsharded module's gradient averaged
over the two batches, each computed in one process with the same random draws.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from penalty_cases import penalty, penalty_value, task_loss
from torch import Tensor, nn

from gradreg.penalties import as_points, interpolate

BATCH, WORLD = 8, 2
LAYOUTS = ("default", "no_reshard_after_forward")
EXACT_PRESETS = ("wgan_gp", "wgan_lp", "r1", "r2", "dragan", "double_backprop", "intermediate",
                 "jacobian", "derivative", "path_length", "param_grad_norm")
#: presets run by finite differences (smooth model): at the points of the critic's outputs
FD_PRESETS = ("wgan_gp", "r1", "r2")
#: param_grad_norm by finite difference (the GNP form): first order, on the parameters that
#: penalty_step holds gathered (refused without the step)
GNP = {"method": "finite_difference", "step": 1e-3}
#: presets with no double backward of their own (method="perturbation"), called with the critic
PERTURBATION_PRESETS = ("approx_r1", "approx_r2")


@dataclass(frozen=True)
class Case:
    preset: str
    dtype: torch.dtype = torch.float32
    layout: str = "default"
    options: dict = field(default_factory=dict)
    callable_outputs: bool = False  # penalty(critic, points): finite differences, chunks
    mixed: bool = False  # bf16 parameters and compute, float32 gradient reduction

    @property
    def name(self) -> str:
        extra = [f"{k}={v}" for k, v in self.options.items()] + ["bf16_params"] * self.mixed
        return "-".join([self.preset, str(self.dtype)[6:], self.layout, *extra])

    @property
    def first_order(self) -> bool:
        """No double backward, on the sharded parameters as they are (without the step):
        finite differences at the points or a perturbation estimate."""
        return ((self.options.get("method") == "finite_difference"
                 and self.preset != "param_grad_norm") or self.preset in PERTURBATION_PRESETS)


CASES = [
    *(Case(p, dtype, layout) for p in EXACT_PRESETS for dtype in (torch.float32, torch.float64)
      for layout in LAYOUTS),
    *(Case(p, dtype, layout, {"method": "finite_difference"}, True) for p in FD_PRESETS
      for dtype in (torch.float32, torch.float64) for layout in LAYOUTS),
    *(Case(p, dtype, layout, callable_outputs=True) for p in PERTURBATION_PRESETS
      for dtype in (torch.float32, torch.float64) for layout in LAYOUTS),
    *(Case("r1", torch.float32, layout, {"chunks": 2}, True) for layout in LAYOUTS),
    *(Case("param_grad_norm", dtype, layout, GNP) for dtype in (torch.float32, torch.float64)
      for layout in LAYOUTS),
    *(Case(p, torch.float32, layout, mixed=True) for p in ("wgan_gp", "r1", "double_backprop")
      for layout in LAYOUTS),
]


class ToBfloat16(nn.Module):
    """What ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` does to the root's inputs."""

    def forward(self, x: Tensor) -> Tensor:
        return x.to(torch.bfloat16)


def critic(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).to(dtype)


def data(rank: int, dtype: torch.dtype) -> Tensor:
    return torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(rank)).to(dtype)


def loss(case: Case, model: nn.Module, x: Tensor, rank: int) -> Tensor:
    """Task loss plus the case's penalty, with the random draws (interpolation, DRAGAN's
    perturbation, projections) seeded by the case and the rank."""
    torch.manual_seed(1000 + rank)
    gp = penalty(case.preset, **case.options)
    if not case.callable_outputs:
        return task_loss(model, x) + penalty_value(gp, model, x)
    points = {"wgan_gp": lambda: interpolate(x, x.flip(0) + 0.5), "r1": lambda: as_points(x),
              "r2": lambda: as_points(x + 0.5), "approx_r1": lambda: as_points(x),
              "approx_r2": lambda: as_points(x + 0.5)}[case.preset]()

    def per_sample(q: Tensor) -> Tensor:
        return model(q).sum(1)
    return task_loss(model, x) + gp(per_sample, points)


def step(case: Case, model: nn.Module, x: Tensor, rank: int,
         around: Callable[[nn.Module], AbstractContextManager] = lambda m: nullcontext()) -> None:
    """One step's gradients on ``model``: forward, penalty and backward inside ``around``."""
    with around(model):
        loss(case, model, x, rank).backward()


def reference(case: Case) -> list[Tensor]:
    """The unsharded critic's parameter gradients averaged over the ranks' batches; for a
    ``mixed`` case the critic in bf16 (its gradients averaged in float32)."""
    grads = []
    for rank in range(WORLD):
        model = critic(case.dtype)
        if case.mixed:
            model = nn.Sequential(ToBfloat16(), model.to(torch.bfloat16))
        step(case, model, data(rank, case.dtype), rank)
        grads.append([p.grad.to(case.dtype) for p in model.parameters()])
    return [sum(g) / WORLD for g in zip(*grads, strict=True)]


STEPS, LR = 3, 0.1


def train(case: Case, model: nn.Module, rank: int,
          around: Callable[[nn.Module], AbstractContextManager]) -> None:
    """``STEPS`` SGD steps of ``case`` on ``model``, batch ``rank + WORLD * step`` at each."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for i in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        step(case, model, data(rank + WORLD * i, case.dtype), rank, around)
        optimizer.step()


def reference_training(case: Case) -> list[Tensor]:
    """:func:`train` on the unsharded critic in one process, each step's gradient averaged over
    the ranks' batches; the final parameters."""
    model = critic(case.dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for i in range(STEPS):
        grads = []
        for rank in range(WORLD):
            optimizer.zero_grad(set_to_none=True)
            step(case, model, data(rank + WORLD * i, case.dtype), rank)
            grads.append([p.grad for p in model.parameters()])
        for p, g in zip(model.parameters(), zip(*grads, strict=True), strict=True):
            p.grad = sum(g) / WORLD
        optimizer.step()
    return [p.detach() for p in model.parameters()]
