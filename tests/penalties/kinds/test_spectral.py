"""Per-sample Jacobian spectral norms by power iteration against the SVD of the full Jacobian."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from gradreg import GradientError
from gradreg.penalties import (
    as_points,
    spectral,
)
from gradreg.penalties.kinds.spectral import power_iteration, spectral_norms

F64 = torch.float64


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _exact(fn, x: Tensor) -> Tensor:
    """σ_max of each sample's Jacobian: torch.linalg.matrix_norm(jacrev(f)(x_i), 2)."""
    return torch.stack([torch.linalg.matrix_norm(jacrev(fn)(xi), 2) for xi in x])


def test_converges_to_the_largest_singular_value_per_sample() -> None:
    net, x = _net(), torch.randn(5, 4, dtype=F64)
    got = spectral_norms(net, x, iterations=300, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(got, _exact(net, x), rtol=1e-9, atol=0)


def test_never_exceeds_the_largest_singular_value() -> None:
    """u, v unit vectors: uᵀJv <= σ_max, for any number of iterations."""
    net, x = _net(), torch.randn(5, 4, dtype=F64)
    exact = _exact(net, x)
    for n in (1, 2, 5):
        got = spectral_norms(net, x, iterations=n, generator=torch.Generator().manual_seed(n))
        assert bool((got <= exact * (1 + 1e-12)).all())


def test_linear_map_and_several_inputs() -> None:
    """f(x, y) = xAᵀ + yBᵀ: J = [A, B] for every sample, σ_max = ‖[A B]‖₂."""
    torch.manual_seed(0)
    a, b = torch.randn(3, 4, dtype=F64), torch.randn(3, 2, dtype=F64)
    x, y = torch.randn(2, 4, dtype=F64), torch.randn(2, 2, dtype=F64)
    got = spectral_norms(lambda p, q: p @ a.T + q @ b.T, (x, y), iterations=200,
                         generator=torch.Generator().manual_seed(0))
    expected = torch.linalg.matrix_norm(torch.cat([a, b], dim=1), 2).expand(2)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)


def _params(net: nn.Module) -> tuple[list[str], tuple[Tensor, ...]]:
    names = [name for name, _ in net.named_parameters()]
    return names, tuple(p.detach().clone().requires_grad_() for p in net.parameters())


def test_gradient_flows_through_the_last_iterate_only() -> None:
    """With 2 iterations (far from converged) the parameter gradient is that of uᵀJv with the
    returned u, v held fixed, J built in full by jacrev (the oracle, itself checked by gradcheck),
    and not the gradient of the whole iteration."""
    net, x = _net(), torch.randn(3, 4, dtype=F64)
    names, params = _params(net)

    def model(*ps: Tensor):
        return lambda q: functional_call(net, dict(zip(names, ps, strict=True)), (q,))

    u, (v,) = power_iteration(model(*params), x, iterations=2,
                              generator=torch.Generator().manual_seed(4))

    def fixed_uv(*ps: Tensor) -> Tensor:
        jac = torch.stack([jacrev(model(*ps))(xi) for xi in x])  # [B, out, in]
        return torch.einsum("bo,boi,bi->b", u, jac, v).square().sum()

    assert torch.autograd.gradcheck(fixed_uv, params)
    got = spectral_norms(model(*params), x, iterations=2,
                         generator=torch.Generator().manual_seed(4)).square().sum()
    jacobian_params = params[:3]  # the last bias does not enter J
    mine = torch.autograd.grad(got, jacobian_params)
    oracle = torch.autograd.grad(fixed_uv(*params), jacobian_params)
    for m, o in zip(mine, oracle, strict=True):
        torch.testing.assert_close(m, o, rtol=1e-10, atol=1e-12)

    def whole(*ps: Tensor) -> Tensor:  # u, v recomputed from the perturbed parameters
        return spectral_norms(model(*ps), x, iterations=2,
                              generator=torch.Generator().manual_seed(4)).square().sum()

    assert not torch.autograd.gradcheck(whole, params, raise_exception=False, fast_mode=True)


def test_converged_gradient_is_that_of_the_largest_singular_value() -> None:
    """At convergence u, v are stationary: gradcheck of the whole function passes (fast mode:
    one random direction in parameter space)."""
    net, x = _net(), torch.randn(2, 4, dtype=F64)
    names, params = _params(net)

    def whole(*ps: Tensor) -> Tensor:
        fn = lambda q: functional_call(net, dict(zip(names, ps, strict=True)), (q,))  # noqa: E731
        return spectral_norms(fn, x, iterations=300,
                              generator=torch.Generator().manual_seed(5)).square().sum()

    assert torch.autograd.gradcheck(whole, params, atol=1e-6, fast_mode=True)


def test_bad_input_is_refused() -> None:
    net, x = _net(), torch.randn(3, 4, dtype=F64)
    with pytest.raises(GradientError, match="pass the model .* not Tensor"):
        spectral_norms(net(x), x)
    with pytest.raises(ValueError, match="iterations must be an int >= 1"):
        spectral_norms(net, x, iterations=0)
    with pytest.raises(GradientError, match=r"D\(x\) rather than D\(x\).mean\(\)"):
        spectral_norms(lambda q: net(q).mean(), x)


def test_spectral_norm_of_a_b_output_and_of_b_points() -> None:
    """f(x) = w.x (output [B]): sigma = |w| = 5, penalty 25; f(x) = 2x on [B] points: 4."""
    w = torch.tensor([3.0, 4.0], dtype=F64)
    x = as_points(torch.randn(3, 2, dtype=F64))
    assert spectral(1.0, iterations=2)(lambda q: q @ w, x).item() == pytest.approx(25.0, rel=1e-12)
    s = as_points(torch.randn(3, dtype=F64))
    assert spectral(1.0, iterations=2)(lambda q: 2 * q, s).item() == pytest.approx(4.0, rel=1e-12)
