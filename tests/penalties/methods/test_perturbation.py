"""Perturbation estimates of squared per-sample gradient norms against closed forms."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.func import functional_call

from gradreg import GradientError
from gradreg.penalties.methods.perturbation import perturbation_sq_norms

F64 = torch.float64


def _probes(shape: tuple[int, ...], seed: int, count: int = 1) -> list[Tensor]:
    """The probes the estimate draws from ``torch.Generator().manual_seed(seed)`` (float32)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).double() for _ in range(count)]


def test_linear_critic_gives_the_squared_projection_of_its_gradient() -> None:
    """D(x) = w·x + b: (D(x + σε) − D(x))²/σ² = (εᵀw)² exactly, whose mean is ‖w‖²."""
    torch.manual_seed(0)
    w, x = torch.randn(6, dtype=F64), torch.randn(4, 6, dtype=F64)

    def critic(q: Tensor) -> Tensor:
        return q @ w + 0.5

    got = perturbation_sq_norms(critic, x, step=0.1, count=3,
                                generator=torch.Generator().manual_seed(1))
    expected = sum((eps @ w).square() for eps in _probes((4, 6), 1, count=3)) / 3
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


def test_mean_over_probes_is_the_exact_squared_norm() -> None:
    """E[(εᵀg)²] = ‖g‖² for ε ~ N(0, I): 40000 probes of one sample of a linear critic give
    ‖w‖² within 4 standard deviations (relative std of one probe √2)."""
    w = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    x = torch.zeros(40000, 3, dtype=F64)  # one sample, each row its own probe
    got = perturbation_sq_norms(lambda q: q @ w, x, generator=torch.Generator().manual_seed(0))
    exact = w.square().sum()  # 5.25
    assert abs(got.mean() - exact) < 4 * (2**0.5 / 200) * exact


def test_quadratic_critic_forward_bias_and_central_exactness() -> None:
    """D(x) = gᵀx + ½xᵀAx: the forward difference over σ is εᵀ∇D(x) + (σ/2) εᵀAε exactly; the
    central difference (D(x+σε) − D(x−σε))/(2σ) is εᵀ∇D(x) exactly (the Hessian term cancels)."""
    torch.manual_seed(0)
    g, a, x = torch.randn(3, dtype=F64), torch.randn(3, 3, dtype=F64), torch.randn(5, 3, dtype=F64)
    a = a + a.T

    def critic(q: Tensor) -> Tensor:
        return q @ g + 0.5 * ((q @ a) * q).sum(1)

    sigma = 0.05
    (eps,) = _probes((5, 3), 2)
    grad = g + x @ a  # ∇D(x_i), one row per sample
    forward = ((eps * grad).sum(1) + sigma / 2 * ((eps @ a) * eps).sum(1)).square()
    central = (eps * grad).sum(1).square()
    for is_central, expected in ((False, forward), (True, central)):
        got = perturbation_sq_norms(critic, x, step=sigma, central=is_central,
                                    generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_vector_outputs_estimate_the_frobenius_norm_of_the_jacobian() -> None:
    """f(x) = xWᵀ: ‖f(x + σε) − f(x)‖²/σ² = ‖Wε‖², one per sample (Jacobian penalty)."""
    torch.manual_seed(0)
    weight, x = torch.randn(4, 3, dtype=F64), torch.randn(5, 3, dtype=F64)
    got = perturbation_sq_norms(lambda q: q @ weight.T, x,
                                generator=torch.Generator().manual_seed(3))
    (eps,) = _probes((5, 3), 3)
    torch.testing.assert_close(got, (eps @ weight.T).square().sum(1), rtol=1e-10, atol=0)


def test_several_inputs_are_each_perturbed() -> None:
    """f(x, y) = x·a + y·b: ((ε_xᵀa + ε_yᵀb))², ε drawn for x then y; E = ‖a‖² + ‖b‖²."""
    a, b = torch.tensor([1.0, 2.0], dtype=F64), torch.tensor([3.0], dtype=F64)
    x, y = torch.randn(4, 2, dtype=F64), torch.randn(4, 1, dtype=F64)
    got = perturbation_sq_norms(lambda p, q: p @ a + q @ b, (x, y),
                                generator=torch.Generator().manual_seed(4))
    generator = torch.Generator().manual_seed(4)
    eps_x = torch.randn(4, 2, generator=generator).double()
    eps_y = torch.randn(4, 1, generator=generator).double()
    torch.testing.assert_close(got, (eps_x @ a + eps_y @ b).square(), rtol=1e-10, atol=0)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0)).double()


def test_parameter_gradient_is_that_of_the_squared_directional_derivative() -> None:
    """∇θ (Δ/σ)² → ∇θ (εᵀ∇ₓD)² as σ → 0 (central difference, σ = 1e-4, error O(σ²)); the
    oracle differentiates εᵀ∇ₓD(x) exactly by double backward."""
    critic = _mlp()
    params = dict(critic.named_parameters())
    x = torch.randn(5, 3, dtype=F64)
    (eps,) = _probes((5, 3), 5)

    got_value = perturbation_sq_norms(critic, x, step=1e-4, central=True,
                                      generator=torch.Generator().manual_seed(5)).sum()
    got = torch.autograd.grad(got_value, list(params.values()))

    points = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(functional_call(critic, params, (points,)).sum(), points,
                               create_graph=True)
    oracle = torch.autograd.grad((eps * g).sum(1).square().sum(), list(params.values()),
                                 allow_unused=True)  # the last bias does not enter ∇ₓD
    for mine, theirs in zip(got, oracle, strict=True):
        theirs = torch.zeros_like(mine) if theirs is None else theirs
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-9)


def test_shared_outputs_give_the_same_value_with_one_forward_fewer() -> None:
    critic, x = _mlp(), torch.randn(4, 3, dtype=F64)
    calls = []

    def counted(q: Tensor) -> Tensor:
        calls.append(q.shape)
        return critic(q)

    alone = perturbation_sq_norms(counted, x, generator=torch.Generator().manual_seed(6))
    assert len(calls) == 2
    shared = perturbation_sq_norms(counted, x, outputs=critic(x),
                                   generator=torch.Generator().manual_seed(6))
    assert len(calls) == 3
    torch.testing.assert_close(shared, alone, rtol=0, atol=0)


class _OnceDifferentiableTanh(torch.autograd.Function):
    """tanh whose backward cannot itself be differentiated (as fused kernels often are)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor) -> Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


def test_runs_on_a_model_without_double_backward() -> None:
    """Only a first-order backward: the parameter gradient equals that of the same estimate
    through torch's own tanh (identical forward and first derivative)."""
    torch.manual_seed(0)
    layer, x = nn.Linear(3, 1).double(), torch.randn(4, 3, dtype=F64)
    grads = []
    for act in (_OnceDifferentiableTanh.apply, torch.tanh):
        value = perturbation_sq_norms(lambda q, act=act: act(layer(q)).flatten(), x,
                                      generator=torch.Generator().manual_seed(7)).mean()
        grads.append(torch.autograd.grad(value, layer.weight)[0])
    # the two backwards of tanh round differently in the last bit (torch's kernel vectorized
    # as the CPU allows, with or without fused multiply-adds), and the gradient of the
    # quotient (f(x + σε) − f(x))/σ multiplies that by 1/σ (σ = 0.01, the default): 16 eps
    # max|g| / σ allowed (7e-15 measured, 1.3e-13 relative on the smallest entry)
    rounding = 16 * torch.finfo(F64).eps * grads[1].abs().max().item() / 0.01
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=rounding)


def test_bad_input_is_refused_with_the_fix() -> None:
    x = torch.randn(4, 3)
    with pytest.raises(GradientError, match="pass the model .* not Tensor"):
        perturbation_sq_norms(x.sum(1), x)
    with pytest.raises(ValueError, match="step .* > 0, got 0"):
        perturbation_sq_norms(lambda q: q.sum(1), x, step=0)
    with pytest.raises(ValueError, match="count must be an int >= 1"):
        perturbation_sq_norms(lambda q: q.sum(1), x, count=0)
    with pytest.raises(GradientError, match="floating-point inputs, got torch.int64"):
        perturbation_sq_norms(lambda q: q.sum(1), torch.ones(4, 3, dtype=torch.long))
    with pytest.raises(GradientError, match=r"D\(x\) rather than D\(x\).mean\(\)"):
        perturbation_sq_norms(lambda q: q.sum(), x)


@pytest.mark.parametrize(("dtype", "sigma", "central", "smallest"), [
    (torch.float32, 2e-5, False, None),  # 2u/σ = 6.0e-3 (u = 2**-24)
    (torch.float32, 1e-5, False, "1.2e-05"),  # 2u/σ = 1.2e-2
    (torch.float32, 1e-5, True, None),  # central: u/σ = 6.0e-3
    (torch.float64, 1e-12, False, None),  # 2u/σ = 2.2e-4
    (torch.bfloat16, 1.0, False, None),  # 2u/σ = 7.8e-3 (u = 2**-8)
    (torch.bfloat16, 0.5, False, "0.78"),  # 2u/σ = 1.6e-2
])
def test_steps_that_rounding_would_swamp_are_refused(dtype: torch.dtype, sigma: float,
                                                     central: bool, smallest: str | None) -> None:
    """Refused exactly where the rounding bound 2u/σ (u/σ central) exceeds 1e-2, naming the
    smallest step that would pass."""
    x = torch.randn(3, 4).to(dtype)

    def estimate() -> Tensor:
        return perturbation_sq_norms(lambda q: q.sum(1), x, step=sigma, central=central)

    if smallest is None:
        assert torch.isfinite(estimate()).all()
    else:
        with pytest.raises(GradientError, match=f"step >= {smallest} in this arithmetic"):
            estimate()
