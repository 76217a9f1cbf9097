"""approx_r1/approx_r2, max_gp, spectral and hessian as presets: oracles, bad input, splits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from gradreg import GradientError
from gradreg.penalties import (
    approx_r1,
    approx_r2,
    as_points,
    derivative,
    double_backprop,
    hessian,
    interpolate,
    jacobian,
    make_penalty,
    max_gp,
    path_length,
    r1,
    spectral,
    wgan_gp,
)

F64 = torch.float64


def critic(n_in: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(n_in, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0)).double()


def classifier() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def probes(shape: tuple[int, ...], seed: int) -> Tensor:
    """The probe the perturbation estimate draws after ``torch.manual_seed(seed)`` (float32)."""
    torch.manual_seed(seed)
    return torch.randn(shape).double()


# ---------------------------------------------------------------------------------------------
# approx_r1 / approx_r2 and method="perturbation"


def test_approx_r1_is_gamma_half_the_mean_squared_difference_over_sigma() -> None:
    """approx_r1(γ)(D, x) = γ/2 · mean_i (D(x_i + σε_i) − D(x_i))² / σ², written out."""
    d, x = critic(), torch.randn(5, 3, dtype=F64)
    torch.manual_seed(3)
    got = approx_r1(4.0, step=0.05)(d, as_points(x))
    eps = probes((5, 3), 3)
    expected = 4.0 / 2 * ((d(x + 0.05 * eps) - d(x)) / 0.05).square().mean()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    torch.manual_seed(3)
    central = approx_r2(4.0, step=0.05, central=True)(d, x)
    expected = 4.0 / 2 * ((d(x + 0.05 * eps) - d(x - 0.05 * eps)) / 0.1).square().mean()
    torch.testing.assert_close(central, expected, rtol=1e-12, atol=0)


def test_approx_r1_means_the_same_gamma_as_r1() -> None:
    """One sample repeated 20000 times, each row its own probe: the mean estimate is r1's value
    within 4 standard errors (relative std √2 per probe; central difference, bias O(σ²))."""
    d = critic()
    x = torch.randn(1, 3, dtype=F64).expand(20000, 3)
    torch.manual_seed(0)
    approx = approx_r1(10.0, central=True)(d, x)
    p = as_points(x[:1])
    exact = r1(10.0)(d(p), p)  # the same for every row
    assert abs(approx.item() / exact.item() - 1) < 4 * 2**0.5 / 20000**0.5


def test_approx_r1_gradient_is_unbiased_for_r1s() -> None:
    """The mean parameter gradient over 20000 probes of one sample is r1's within 5%."""
    d = critic()
    x = torch.randn(1, 3, dtype=F64).expand(20000, 3)
    params = list(d.parameters())[:3]  # the last bias does not enter ∇D
    torch.manual_seed(1)
    got = torch.autograd.grad(approx_r1(10.0, central=True)(d, x), params)
    p = as_points(x[:1])
    expected = torch.autograd.grad(r1(10.0)(d(p), p), params)
    flat = torch.cat([g.flatten() for g in got])
    ref = torch.cat([g.flatten() for g in expected])
    assert ((flat - ref).norm() / ref.norm()).item() < 0.05


def test_double_backprop_and_jacobian_take_the_perturbation_method() -> None:
    """double_backprop: mean_i (loss_i(x + σε) − loss_i(x))²/σ²; jacobian: mean_i
    ‖f(x + σε) − f(x)‖²/σ², an estimate of ‖J‖_F² (the projections are not used)."""
    model, x, y = classifier(), torch.randn(5, 4, dtype=F64), torch.tensor([0, 1, 2, 0, 1])

    def losses(q: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(model(q), labels, reduction="none")

    torch.manual_seed(2)
    got = double_backprop(0.5, method="perturbation")(losses, x, fn_args=(y,))
    eps = probes((5, 4), 2)
    expected = 0.5 * ((losses(x + 0.01 * eps, y) - losses(x, y)) / 0.01).square().mean()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    torch.manual_seed(2)
    got = jacobian(0.5, method="perturbation")(model, x)
    expected = 0.5 * ((model(x + 0.01 * eps) - model(x)) / 0.01).square().sum(1).mean()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


def test_perturbation_refuses_what_it_cannot_estimate() -> None:
    d, x = critic(), as_points(torch.randn(4, 3, dtype=F64))
    with pytest.raises(ValueError, match="need outputs as a callable .* not a tensor"):
        approx_r1()(d(x), x)
    with pytest.raises(ValueError, match="squared per-sample norms with target 0"):
        wgan_gp(method="perturbation")
    with pytest.raises(ValueError, match="squared per-sample norms with target 0"):
        path_length(method="perturbation")
    with pytest.raises(ValueError, match="^step=0.1 is not an option of "
                                         "method='double_backward', kind='gradient_norm'"):
        r1(step=0.1)
    with pytest.raises(ValueError, match="^central=True is not an option of .* choose "
                                         "method='perturbation'"):
        r1(central=True)
    with pytest.raises(ValueError, match="step .* must be a number > 0 or None .* got 0"):
        approx_r1(step=0)
    with pytest.raises(ValueError, match="count .* must be an int >= 1 or None"):
        approx_r1(count=0)
    with pytest.raises(ValueError, match="^chunks=2 is not an option of method='perturbation'"):
        approx_r1(chunks=2)
    with pytest.raises(ValueError, match="^count=4 is not an option of .* or "
                                         "projection='orthonormal'"):
        r1(count=4)
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1), nn.Flatten(0))
    with pytest.raises(GradientError, match="BatchNorm in training mode"):
        approx_r1()(bn.double(), x)
    generator = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    for method in ("finite_difference", "double_backward"):
        with pytest.raises(GradientError, match="kind='hessian' .*BatchNorm in training mode"):
            hessian(method=method)(generator.double(), x)
    assert torch.isfinite(hessian()(generator.double().eval(), x))  # eval mode: per sample
    with pytest.raises(GradientError, match="kind='spectral' runs the model under torch.func.*"
                       "BatchNorm in training mode"):
        spectral()(generator.double().train(), x)
    assert torch.isfinite(spectral()(generator.double().eval(), x))


def test_perturbation_runs_where_double_backward_cannot() -> None:
    """A critic with an op whose backward is not differentiable: r1 refuses it with its clear
    error; approx_r1 gives it the parameter gradient of the same critic through torch's tanh
    (first-order backward only, same probes)."""

    class OnceDifferentiableTanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: Tensor) -> Tensor:
            y = torch.tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad: Tensor) -> Tensor:
            (y,) = ctx.saved_tensors
            return grad * (1 - y * y)

    torch.manual_seed(0)
    hidden, out = nn.Linear(3, 4).double(), nn.Linear(4, 1).double()

    def d(q: Tensor) -> Tensor:
        return out(OnceDifferentiableTanh.apply(hidden(q))).flatten()

    def twin(q: Tensor) -> Tensor:  # the same critic through torch's tanh
        return out(torch.tanh(hidden(q))).flatten()

    x = as_points(torch.randn(4, 3, dtype=F64))
    with pytest.raises(GradientError, match="once_differentiable"):
        r1()(d(x), x)
    params = [hidden.weight, hidden.bias, out.weight]
    grads = []
    for critic_fn in (d, twin):
        torch.manual_seed(0)
        grads.append(torch.autograd.grad(approx_r1()(critic_fn, x), params))
    for mine, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=0)
        assert bool(mine.abs().sum() > 0)


# ---------------------------------------------------------------------------------------------
# max_gp


def studiogan_maxgrad_penalty(real: Tensor, fake: Tensor, alpha: Tensor, discriminator) -> Tensor:
    """StudioGAN's ``cal_maxgrad_penalty`` with its ``alpha`` passed in:

        interpolates = alpha * real_images + ((1 - alpha) * fake_images)
        grads = cal_deriv(inputs=interpolates, outputs=adv_output)   # autograd.grad, ones
        grads = grads.view(grads.size(0), -1)
        maxgrad_penalty = torch.max(grads.norm(2, dim=1)**2)

    and the loss adds ``maxgp_lambda * maxgrad_penalty``.
    """
    interpolates = (alpha * real + (1 - alpha) * fake).requires_grad_()
    out = discriminator(interpolates)
    (grads,) = torch.autograd.grad(out, interpolates, torch.ones_like(out), create_graph=True)
    grads = grads.view(grads.size(0), -1)
    return torch.max(grads.norm(2, dim=1) ** 2)


def test_max_gp_equals_studiogans_formula_and_passes_gradcheck() -> None:
    d = critic()
    torch.manual_seed(0)
    real, fake = torch.randn(6, 3, dtype=F64), torch.randn(6, 3, dtype=F64)
    alpha = torch.rand(6, 1, dtype=F64)
    x_hat = interpolate(real, fake, alpha, alpha_on="real")
    got = max_gp(2.0)(d(x_hat), x_hat)
    expected = 2.0 * studiogan_maxgrad_penalty(real, fake, alpha, d)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)

    names = [n for n, _ in d.named_parameters()]

    def penalty_of(*params: Tensor) -> Tensor:
        return max_gp()(functional_call(d, dict(zip(names, params, strict=True)), (x_hat,)),
                        x_hat)

    params = tuple(p.detach().clone().requires_grad_() for p in d.parameters())
    assert torch.autograd.gradcheck(penalty_of, params)


def test_max_gp_does_not_split_over_micro_batches() -> None:
    """The maximum of the whole batch is the maximum of the micro-batches' maxima, not their
    mean (what averaging over DDP ranks or accumulation steps gives); a split is refused."""
    d = critic()
    x = as_points(torch.randn(8, 3, dtype=F64))
    full = max_gp()(d(x), x)
    halves = [max_gp()(d(h), h) for h in (as_points(x[:4].detach()), as_points(x[4:].detach()))]
    assert full.item() == max(h.item() for h in halves)
    assert full.item() > sum(h.item() for h in halves) / 2
    with pytest.raises(ValueError, match="reduction='max' takes the largest value over the whole"):
        max_gp(chunks=2)
    with pytest.raises(ValueError, match="use subsample=1 and chunks=1"):
        max_gp(subsample=0.5)


# ---------------------------------------------------------------------------------------------
# spectral


def sigma_max(model: nn.Module, x: Tensor) -> Tensor:
    return torch.stack([torch.linalg.matrix_norm(jacrev(model)(xi), 2) for xi in x])


def test_spectral_value_and_lipschitz_target_against_the_svd() -> None:
    model, x = classifier(), torch.randn(5, 4, dtype=F64)
    exact = sigma_max(model, x)
    got = spectral(0.5, iterations=300)(model, x)
    torch.testing.assert_close(got, 0.5 * exact.square().mean(), rtol=1e-9, atol=0)
    c = exact.median().item()  # some samples above the target, some below
    got = spectral(0.5, iterations=300, target=c, one_sided=True)(model, x)
    torch.testing.assert_close(got, 0.5 * (exact - c).clamp_min(0).square().mean(),
                               rtol=1e-8, atol=1e-12)


def test_spectral_passes_gradcheck_and_splits_over_micro_batches() -> None:
    model, x = classifier(), torch.randn(4, 4, dtype=F64)
    names = [n for n, _ in model.named_parameters()]

    def penalty_of(*params: Tensor) -> Tensor:
        torch.manual_seed(0)
        fn = lambda q: functional_call(model, dict(zip(names, params, strict=True)), (q,))  # noqa: E731
        return spectral(iterations=300)(fn, x)

    params = tuple(p.detach().clone().requires_grad_() for p in model.parameters())
    assert torch.autograd.gradcheck(penalty_of, params, atol=1e-6, fast_mode=True)
    full = spectral(iterations=300)(model, x)
    halves = [spectral(iterations=300)(model, h) for h in (x[:2], x[2:])]
    torch.testing.assert_close(full, (halves[0] + halves[1]) / 2, rtol=1e-9, atol=0)


def test_spectral_bad_input() -> None:
    model, x = classifier(), torch.randn(3, 4, dtype=F64)
    with pytest.raises(ValueError, match="kind='spectral'.* need outputs as a callable"):
        spectral()(model(x), x)
    with pytest.raises(ValueError, match="operator 2-norm; got p=1"):
        spectral(p=1)
    with pytest.raises(ValueError, match="kind='spectral' is computed by method 'double_backward'"):
        spectral(method="finite_difference")
    with pytest.raises(ValueError, match="iterations must be an int >= 1"):
        spectral(iterations=0)
    with pytest.raises(ValueError, match="loss_scale is only supported .* kind='spectral'"):
        spectral()(model, x, loss_scale=1024.0)


# ---------------------------------------------------------------------------------------------
# hessian


def generator() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4), nn.Softplus()).double()


def test_hessian_preset_is_the_authors_penalty() -> None:
    """weight · max over samples and units of the unbiased variance over k Rademacher draws of
    (G(z + εv) − 2G(z) + G(z − εv))/ε², the directions drawn by torch.randint(0, 2) after the
    same seed (the authors' formula, written out in kinds/test_hessian.py)."""
    g, z = generator(), torch.randn(5, 3, dtype=F64)
    torch.manual_seed(4)
    got = hessian(0.3, count=3)(g, as_points(z))
    torch.manual_seed(4)
    v = torch.randint(0, 2, (3, 5, 3)).to(F64) * 2 - 1
    sdd = torch.stack([(g(z + 0.1 * vi) - 2 * g(z) + g(z - 0.1 * vi)) / 0.1**2 for vi in v])
    torch.testing.assert_close(got, 0.3 * sdd.var(dim=0, unbiased=True).max(), rtol=1e-12,
                               atol=0)


def test_hessian_exact_method_agrees_with_finite_differences() -> None:
    g, z = generator(), torch.randn(5, 3, dtype=F64)
    values = []
    for method in ("double_backward", "finite_difference"):
        torch.manual_seed(5)
        values.append(hessian(reduction="mean", method=method,
                              **({"step": 1e-3} if method == "finite_difference" else {}))(g, z))
    torch.testing.assert_close(values[1], values[0], rtol=1e-5, atol=0)


def test_hessian_bad_input() -> None:
    g, z = generator(), torch.randn(5, 3, dtype=F64)
    with pytest.raises(ValueError, match="count .* must be an int >= 2 .* variance"):
        hessian(count=1)
    with pytest.raises(ValueError, match="step .* must be a number > 0 or None .* got 0"):
        hessian(step=0.0)
    with pytest.raises(ValueError, match="^epsilon is the step of kind='hessian' by "
                                         "method='finite_difference'; "
                                         "method='double_backward' takes none"):
        hessian(method="double_backward", step=0.1)
    with pytest.raises(ValueError, match="reduces by 'max' .* or 'mean', got reduction='sum'"):
        hessian(reduction="sum")
    with pytest.raises(ValueError, match="'finite_difference' or 'double_backward', got "
                                         "method='perturbation'"):
        hessian(method="perturbation")
    with pytest.raises(ValueError, match="need outputs as a callable"):
        hessian()(g(z), z)
    with pytest.raises(GradientError, match="w.r.t. one input .* got 2"):
        hessian()(lambda a, b: g(a + b), (z, torch.zeros_like(z)))
    with pytest.raises(ValueError, match="kind must be one of"):
        make_penalty("r1", kind="laplacian")
    with pytest.raises(ValueError, match="variance, not a norm: target, one_sided"):
        hessian(target=1.0)
    with pytest.raises(ValueError, match="^count=4 is not an option of "):
        make_penalty("r1", count=4)
    with pytest.raises(ValueError, match="^iterations=5 is not an option of .* choose "
                                         "kind='spectral'"):
        make_penalty("jacobian", iterations=5)


# ---------------------------------------------------------------------------------------------
# every preset: gradcheck of parameters -> penalty in float64, the random draws seeded


@pytest.mark.parametrize("name", ["approx_r1", "approx_r2", "max_gp", "spectral", "hessian"])
def test_gradcheck_parameters_to_penalty(name: str) -> None:
    """The penalty as a function of the parameters, its draws (probes, start vector, directions)
    seeded: autograd's derivative equals finite differences (the spectral norm's at convergence,
    where the fixed last iterate gives the derivative of σ_max itself)."""
    model = {"spectral": classifier, "hessian": generator}.get(name, critic)()
    x = torch.randn(4, 4 if name == "spectral" else 3, dtype=F64)
    names = [n for n, _ in model.named_parameters()]
    options = {"iterations": 300} if name == "spectral" else {}

    def penalty_of(*params: Tensor) -> Tensor:
        def fn(q: Tensor) -> Tensor:
            return functional_call(model, dict(zip(names, params, strict=True)), (q,))

        torch.manual_seed(0)
        gp, points = make_penalty(name, **options), as_points(x)
        return gp(fn(points), points) if name == "max_gp" else gp(fn, points)

    params = tuple(p.detach().clone().requires_grad_() for p in model.parameters())
    assert penalty_of(*params).item() > 0
    assert torch.autograd.gradcheck(penalty_of, params, eps=1e-6, atol=1e-6, rtol=1e-4,
                                    fast_mode=name == "spectral")


def test_derivative_of_a_one_dimensional_function_takes_b_points() -> None:
    """u(x) = x^3 at x = [1, 2]: u'' = 6x, the penalty mean (6x)^2 = (36 + 144) / 2 = 90."""
    x = as_points(torch.tensor([1.0, 2.0], dtype=F64))
    assert derivative(1.0)(x.pow(3), x).item() == pytest.approx(90.0, rel=1e-14)
    # R1 of D(x) = 3x per sample: 10/2 * 9 = 45
    assert r1()(3 * x, x).item() == pytest.approx(45.0, rel=1e-14)
    one = torch.tensor(2.0, dtype=F64, requires_grad=True)  # a 0-d point: one sample
    assert r1()(3 * one, one).item() == pytest.approx(45.0, rel=1e-14)
