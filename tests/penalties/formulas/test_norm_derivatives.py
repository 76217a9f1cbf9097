"""The 2-norm and the square root of the penalties carry their own derivatives (one kernel
forward, four backward): checked against finite differences to the second order (gradcheck,
gradgradcheck, float64), and at 0 against the chain of ``where``s they replace."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.autograd import gradcheck, gradgradcheck

from gradreg.penalties import per_sample_norm
from gradreg.penalties.formulas.norms import safe_sqrt


def where_sqrt(sq: Tensor) -> Tensor:
    """The formula the derivative replaces: sqrt, its gradient 0 at 0 by two ``where``s."""
    positive = sq != 0
    return torch.where(positive, torch.where(positive, sq, 1.0).sqrt(), 0.0)


def where_norm(*grads: Tensor) -> Tensor:
    return where_sqrt(sum(g.flatten(1).square().sum(1) for g in grads))


def test_the_norm_and_the_root_agree_with_finite_differences_to_the_second_order() -> None:
    torch.manual_seed(0)
    g, h = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, 2, dtype=torch.float64)
    g[1], h[1] = 0.0, 0.0  # a sample whose gradient vanishes: away from it the norm is smooth
    rows = (g.requires_grad_(), h.requires_grad_())
    for fn in (lambda *t: per_sample_norm(t[:1]), lambda *t: per_sample_norm(t),
               lambda *t: per_sample_norm(t, per_sample=False)):
        smooth = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True),
                  torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True))
        assert gradcheck(fn, smooth) and gradgradcheck(fn, smooth)
    sq = torch.rand(5, dtype=torch.float64).add(0.1).requires_grad_()
    assert gradcheck(safe_sqrt, (sq,)) and gradgradcheck(safe_sqrt, (sq,))
    # at the vanishing sample: value, gradient and second derivative those of the where chain
    for ours, theirs, inputs in ((lambda *t: per_sample_norm(t), where_norm, rows),
                                 (safe_sqrt, where_sqrt, (torch.tensor(
                                     [0.0, 4.0], dtype=torch.float64, requires_grad=True),))):
        a, b = ours(*inputs), theirs(*inputs)
        torch.testing.assert_close(a, b, rtol=1e-15, atol=0)
        weights = torch.tensor([0.3, 0.7, -1.1], dtype=torch.float64)[:a.shape[0]]
        da = torch.autograd.grad((a * weights).sum(), inputs, create_graph=True)
        db = torch.autograd.grad((b * weights).sum(), inputs, create_graph=True)
        for x, y in zip(da, db, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-14, atol=0)
        dda = torch.autograd.grad(sum(d.square().sum() for d in da), inputs)
        ddb = torch.autograd.grad(sum(d.square().sum() for d in db), inputs)
        for x, y in zip(dda, ddb, strict=True):
            assert torch.isfinite(x).all()
            torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("fn", [safe_sqrt, lambda sq: per_sample_norm(sq.unsqueeze(1) / 3)])
def test_a_nan_stays_nan_and_zero_has_gradient_zero(fn) -> None:
    """A NaN stays NaN (the finite check sees it); at 0 the value and the gradient are 0."""
    sq = torch.tensor([float("nan"), 0.0, 9.0], requires_grad=True)
    value = fn(sq)
    assert value[0].isnan() and value[1] == 0 and value[2] == 3
    (grad,) = torch.autograd.grad(value[1:].sum(), sq)
    assert grad[1] == 0
