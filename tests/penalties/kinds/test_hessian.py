"""The Hessian penalty against the authors' analytic case and their code, written out here."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from gradreg import GradientError
from gradreg.penalties.kinds.hessian import (
    hessian_penalty,
    second_directional_derivatives,
)

F64 = torch.float64


def _authors_hessian_penalty(G, z: Tensor, xs: Tensor, epsilon: float, reduction) -> Tensor:
    """The authors' ``hessian_penalty_pytorch.py`` (Peebles et al. 2020), with their random
    ``xs = epsilon * rademacher((k, *z.size()))`` passed in:

        G_z = G(z)
        for x in xs:
            sdd = [(G2x - 2 * G_z_base + Gfx) / epsilon ** 2
                   for G2x, G_z_base, Gfx in zip(listify(G(z + x)), listify(G_z),
                                                 listify(G(z - x)))]
        for activ_n in zip(*second_orders):            # one output (layer) at a time
            var_tensor = torch.var(torch.stack(activ_n), dim=0, unbiased=True)
            sum_of_penalties += reduction(var_tensor)
    """
    def listify(out):
        return out if isinstance(out, list) else [out]

    G_z = G(z)
    second_orders = [[(G2x - 2 * G_z_base + Gfx) / (epsilon**2)
                      for G2x, G_z_base, Gfx in zip(listify(G(z + x)), listify(G_z),
                                                    listify(G(z - x)), strict=True)]
                     for x in xs]
    total = 0
    for activ_n in zip(*second_orders, strict=True):
        total = total + reduction(torch.var(torch.stack(activ_n), dim=0, unbiased=True))
    return total


def _g1(z: Tensor) -> Tensor:
    return z[:, 0] * z[:, 1]


def _g2(z: Tensor) -> Tensor:
    return z[:, 0] ** 2 * z[:, 1]


@pytest.mark.parametrize("method", ["double_backward", "finite_difference"])
def test_the_authors_analytic_case(method: str) -> None:
    """G(z) = [z0·z1, z0²·z1] has Hessian penalties [4, 16·z0²].

    Derivation: H(z0·z1) = [[0, 1], [1, 0]], so vᵀHv = 2·v0·v1 ∈ {−2, 2} with equal
    probability for Rademacher v: Var = E[(2 v0 v1)²] − (E[2 v0 v1])² = 4 − 0 = 4.
    H(z0²·z1) = [[2 z1, 2 z0], [2 z0, 0]], so vᵀHv = 2 z1 v0² + 4 z0 v0 v1 = 2 z1 + 4 z0 v0 v1
    (v0² = 1): Var = 16 z0² E[(v0 v1)²] = 16 z0².
    The penalty's unbiased variance over k = 2 draws has these as expectation: averaged over all
    16 equally likely pairs of directions from {±1}², it equals them exactly. The finite
    difference is exact here too (polynomials of degree <= 3).
    """
    z = torch.tensor([[0.7, -1.3]], dtype=F64)
    signs = [torch.tensor([[a, b]], dtype=F64) for a in (-1.0, 1.0) for b in (-1.0, 1.0)]
    pairs = [torch.stack(pair) for pair in itertools.product(signs, repeat=2)]  # [2, 1, 2] each
    for fn, expected in ((_g1, 4.0), (_g2, 16 * 0.7**2)):
        values = torch.stack([hessian_penalty(fn, z, count=2, directions=d, method=method)
                              for d in pairs])
        torch.testing.assert_close(values.mean(), torch.tensor(expected, dtype=F64),
                                   rtol=1e-9, atol=1e-9)
    v = signs[1]  # (−1, 1): v0·v1 = −1
    (sdd,) = second_directional_derivatives(_g2, z, v, method=method)
    torch.testing.assert_close(sdd, 2 * z[:, 1] - 4 * z[:, 0], rtol=1e-9, atol=1e-9)


def _generator() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4), nn.Softplus()).double()


def _layers(net: nn.Module):
    """G returning a list of two layers' outputs (the penalty sums over them)."""
    def G(z: Tensor) -> list[Tensor]:
        hidden = net[1](net[0](z))
        return [hidden, net[3](net[2](hidden))]
    return G


@pytest.mark.parametrize("reduction", ["max", "mean"])
def test_finite_difference_equals_the_authors_code(reduction: str) -> None:
    net, z = _generator(), torch.randn(5, 3, dtype=F64)
    directions = torch.randint(0, 2, (3, 5, 3), generator=torch.Generator().manual_seed(1))
    directions = directions.to(F64) * 2 - 1
    epsilon = 0.1
    mine = hessian_penalty(_layers(net), z, count=3, step=epsilon, reduction=reduction,
                           directions=directions)
    theirs = _authors_hessian_penalty(_layers(net), z, epsilon * directions, epsilon,
                                      torch.max if reduction == "max" else torch.mean)
    torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=0)
    drawn = torch.randint(0, 2, (3, 5, 3), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(  # the same directions when drawn from the same generator
        hessian_penalty(_layers(net), z, count=3, reduction=reduction,
                        generator=torch.Generator().manual_seed(1)),
        _authors_hessian_penalty(_layers(net), z, epsilon * (drawn.to(F64) * 2 - 1), epsilon,
                                 torch.max if reduction == "max" else torch.mean),
        rtol=1e-12, atol=0)


@pytest.mark.parametrize("reduction", ["max", "mean"])
def test_finite_difference_converges_to_exact(reduction: str) -> None:
    """Error O(ε²): the value and its parameter gradient agree to ~ε² relative at ε = 1e-3."""
    net, z = _generator(), torch.randn(5, 3, dtype=F64)
    params = list(net.parameters())
    values, grads = [], []
    for method in ("double_backward", "finite_difference"):
        value = hessian_penalty(_layers(net), z, count=4, step=1e-3, reduction=reduction,
                                method=method, generator=torch.Generator().manual_seed(2))
        values.append(value)
        grads.append(torch.autograd.grad(value, params))
    torch.testing.assert_close(values[1], values[0], rtol=1e-5, atol=0)
    for fd, exact in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(fd, exact, rtol=1e-4, atol=1e-8)


def test_exact_form_passes_gradcheck() -> None:
    """The exact penalty's derivative w.r.t. the parameters and z, against finite differences
    of the function itself (mean reduction: max is not differentiable at ties)."""
    net = _generator()
    names = [name for name, _ in net.named_parameters()]
    z = torch.randn(4, 3, dtype=F64, requires_grad=True)
    directions = torch.randint(0, 2, (2, 4, 3), generator=torch.Generator().manual_seed(3))
    directions = directions.to(F64) * 2 - 1

    def penalty(z: Tensor, *params: Tensor) -> Tensor:
        def G(q: Tensor) -> Tensor:
            return functional_call(net, dict(zip(names, params, strict=True)), (q,))
        return hessian_penalty(G, z, count=2, reduction="mean", method="double_backward",
                               directions=directions)

    params = tuple(p.detach().clone().requires_grad_() for p in net.parameters())
    assert torch.autograd.gradcheck(penalty, (z, *params))


def test_bad_options_are_refused() -> None:
    z = torch.randn(2, 2)
    with pytest.raises(ValueError, match=r"count .* must be an int >= 2 or None \(its default\): "
                                         r"the Hessian penalty is a variance .*; got 1\.$"):
        hessian_penalty(_g1, z, count=1)
    with pytest.raises(ValueError, match=r"step .* must be a number > 0 or None .*, got 0\.0\.$"):
        hessian_penalty(_g1, z, step=0.0)
    with pytest.raises(ValueError, match="reduces by 'max' .* or 'mean', got reduction='sum'"):
        hessian_penalty(_g1, z, reduction="sum")
    with pytest.raises(ValueError, match="computed by method 'finite_difference' or "
                                         "'double_backward', got method='exact'"):
        hessian_penalty(_g1, z, method="exact")
    with pytest.raises(GradientError, match=r"expected \[count, \*z.shape\]"):
        hessian_penalty(_g1, z, directions=torch.ones(2, 3, 2))
    with pytest.raises(GradientError, match="floating-point input z"):
        hessian_penalty(_g1, torch.ones(2, 2, dtype=torch.long))


def test_a_second_difference_that_rounding_would_swamp_is_refused() -> None:
    """float32 (u = 2**-24): 4u/ε² is 2.4e-5 at the authors' ε = 0.1 (runs) and 0.24 at ε = 1e-3
    (refused, naming the smallest ε that passes, sqrt(4u/1e-2) = 4.9e-3, and the exact form)."""
    z = torch.randn(4, 3)

    def G(q: Tensor) -> Tensor:
        return torch.tanh(q).prod(1, keepdim=True)

    assert torch.isfinite(hessian_penalty(G, z, step=0.1))
    with pytest.raises(GradientError,
                       match=r"up to 0\.24 .* step >= 0\.0049 .*method='double_backward'"):
        hessian_penalty(G, z, step=1e-3)
