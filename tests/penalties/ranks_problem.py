"""The problem of the over-ranks test: a float64 MLP, a batch of 16, and one
accumulated step of a parameter penalty (the one-process reference and each rank's share)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from gradreg.penalties import LossAt, accumulated_backward, param_grad_norm, penalized_backward

METHODS = ("finite_difference", "double_backward")
WEIGHT, STEP = 0.5, 1e-5


def problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    return model, torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, method: str, *,
         micro_batches: int = 1, sizes: list[int] | None = None, over_ranks: bool = False
         ) -> dict[str, torch.Tensor]:
    """``.grad`` after one ``accumulated_backward`` of ``param_grad_norm`` by ``method`` over
    ``micro_batches`` equal parts of ``(x, y)`` (or parts of ``sizes`` rows), with the loss and
    the weighted penalty."""
    params = list(model.parameters())
    options = {"step": STEP} if method == "finite_difference" else {}
    penalty = param_grad_norm(WEIGHT, method=method, **options)
    sizes = sizes or [len(x) // micro_batches] * micro_batches
    starts = [sum(sizes[:k]) for k in range(len(sizes))]

    def loss(rows: slice) -> torch.Tensor:
        return F.cross_entropy(model(x[rows]), y[rows])

    losses = [partial(loss, slice(start, start + n)) for start, n in zip(starts, sizes,
                                                                         strict=True)]
    task, value = accumulated_backward(penalty, losses, params, rows=sizes, on=(x,),
                                       over_ranks=over_ranks)
    return {"grad": torch.cat([p.grad.flatten() for p in params]), "loss": task,
            "penalty": value}


#: the steps that add a gradient to ``.grad`` themselves
OWN_STEPS = ("penalized_backward", "accumulated_backward")


def own_step(model: nn.Module, forward: nn.Module, x: torch.Tensor, y: torch.Tensor,
             how: str) -> torch.Tensor:
    """``.grad`` after one step ``how`` (:data:`OWN_STEPS`) of ``param_grad_norm`` by finite
    difference of the loss of ``forward`` (``model`` itself, or ``model`` wrapped in DDP) on
    ``(x, y)``: the rank's own penalty."""
    params = list(model.parameters())
    penalty = param_grad_norm(WEIGHT, method="finite_difference", step=STEP)

    def loss() -> torch.Tensor:
        return F.cross_entropy(forward(x), y)

    if how == "penalized_backward":
        penalized_backward(penalty, LossAt.run(loss, x), params)
    else:
        accumulated_backward(penalty, [loss], params, on=(x,))
    return torch.cat([p.grad.flatten() for p in params])
