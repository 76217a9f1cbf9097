"""The value of a penalty and the parameter gradient of one backward of it, shared by the
penalty tests."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gradreg.penalties import GradientPenalty


def value_and_grad(penalty: GradientPenalty, model: nn.Module, fn: object,
                   x: Tensor) -> tuple[Tensor, Tensor]:
    """``penalty(fn, x)`` and the gradient of its backward w.r.t. every parameter of ``model``,
    flattened into one vector (zeros where a parameter gets none)."""
    model.zero_grad(set_to_none=True)
    value = penalty(fn, x)
    value.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
    return value.detach(), torch.cat([g.flatten() for g in grads])
