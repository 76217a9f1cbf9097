"""Random layers in training mode under the penalties that run the model more than once per call:
every forward of one call draws the random numbers of the first (or of the task's forward, through
SharedForward), so each method equals its exact form for that one draw (the same dropout mask).

The reference of each test is computed without the penalty: the model's forward from the same
random state (``torch.set_rng_state``), differentiated by plain autograd, or a deterministic copy
of the model with the mask of that forward written in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradreg import GradientError
from gradreg.penalties import GeneratorState, SharedForward, make_penalty
from gradreg.penalties.kinds.hessian import hessian_penalty, rademacher
from gradreg.penalties.kinds.spectral import spectral_norms
from gradreg.penalties.methods.perturbation import perturbation_sq_norms
from tests.penalties.parameter_gradients import value_and_grad

F64 = torch.float64


class FunctionalDropout(nn.Module):
    def forward(self, h: Tensor) -> Tensor:
        return F.dropout(h, 0.3, training=self.training)


class UniformNoise(nn.Module):
    """``torch.rand*`` inside forward: additive noise in training mode."""

    def forward(self, h: Tensor) -> Tensor:
        return h + 0.1 * torch.rand_like(h) if self.training else h


class StochasticDepth(nn.Module):
    """A residual branch kept per sample with probability 0.7 (rescaled), as in stochastic
    depth's row mode."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(self, h: Tensor) -> Tensor:
        keep = (torch.rand(h.shape[0], 1, dtype=h.dtype) < 0.7).to(h.dtype) / 0.7
        return h + keep * self.branch(h) if self.training else h + self.branch(h)


RANDOM_LAYERS = {
    "dropout": lambda: nn.Dropout(0.3),
    "alpha_dropout": lambda: nn.AlphaDropout(0.3),
    "functional_dropout": FunctionalDropout,
    "rand_in_forward": UniformNoise,
    "rrelu": nn.RReLU,
    "stochastic_depth": StochasticDepth,
}


def critic(layer: str = "dropout", n_out: int = 1) -> nn.Module:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), RANDOM_LAYERS[layer](),
                         nn.Linear(8, n_out))
    return (nn.Sequential(body, nn.Flatten(0)) if n_out == 1 else body).to(F64).train()


def batch(n: int = 6, dim: int = 3) -> Tensor:
    return torch.randn(n, dim, dtype=F64, generator=torch.Generator().manual_seed(1))


def forward_from(state: Tensor, model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """The model at a leaf copy of ``x``, its forward run from the random state ``state``."""
    torch.set_rng_state(state)
    q = x.detach().clone().requires_grad_()
    return q, model(q)


def probe_after(state: Tensor, model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """The input gradient of the forward from ``state`` and the probe ε drawn after it (float32,
    as the perturbation estimate draws it)."""
    q, out = forward_from(state, model, x)
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    eps = torch.randn(x.shape, dtype=torch.float32).to(F64)
    return g, eps


@pytest.mark.parametrize("layer", RANDOM_LAYERS)
def test_perturbation_is_the_squared_directional_derivative_for_the_first_forwards_draw(
        layer: str) -> None:
    """(f(x + σε; m) − f(x; m))²/σ² = (εᵀ∇f(x; m))² + O(σ) for one draw m. Without the replay
    the perturbed forward drew its own m' and the quotient was (f(x; m') − f(x; m))²/σ²:
    a factor of about 4000 on the dropout critic."""
    model, x = critic(layer), batch()
    torch.manual_seed(3)
    state = torch.get_rng_state()
    estimate = perturbation_sq_norms(model, x, step=1e-7)
    g, eps = probe_after(state, model, x)
    expected = (eps * g).sum(1).square().detach()
    assert expected.max() > 1e-3
    # rounding: the outputs carry a few ulps each (their sums vectorized as the CPU does), so
    # the quotient (f(x + σε) − f(x))/σ is off by δ ≤ 16 eps max|f| / σ and its square by
    # 2 δ |εᵀg| + δ² (a sample with a small εᵀg has nothing else to hide it in: 2.4e-11 at
    # |εᵀg| = 2e-3 measured); the truncation, O(σ) relative, is in rtol
    delta = 16 * torch.finfo(F64).eps * forward_from(state, model, x)[1].abs().max() / 1e-7
    allowed = 1e-5 * expected + 2 * delta * expected.sqrt() + delta**2
    assert ((estimate - expected).abs() <= allowed).all(), (estimate - expected) / allowed


@pytest.mark.parametrize("central", [False, True], ids=["forward", "central"])
def test_approx_r1_on_the_task_forward_replays_its_mask(central: bool) -> None:
    """approx_r1 given the task's forward (SharedForward: outputs and the state it began with):
    value and parameter gradient are those of λ/2 mean_i (εᵢᵀ∇f(xᵢ; m))², m the task's mask,
    and the model runs once more (once per side when central), not at x."""
    model, x = critic(), batch()
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    torch.manual_seed(4)
    state = torch.get_rng_state()
    shared = SharedForward.run(model, x)
    penalty = make_penalty("approx_r1", step=1e-7, central=central)
    model.zero_grad()
    value = penalty(shared, x)
    value.backward()
    hook.remove()
    assert len(forwards) == (3 if central else 2)
    got = [p.grad.clone() for p in model.parameters()]

    g, _ = probe_after(state, model, x)
    torch.set_rng_state(state)  # the probe is drawn after the task's forward
    model(x)
    eps = torch.randn(x.shape, dtype=torch.float32).to(F64)
    expected = 10.0 * 0.5 * (eps * g).sum(1).square().mean()
    torch.testing.assert_close(value.detach(), expected.detach(), rtol=1e-5, atol=0)
    oracle = torch.autograd.grad(expected, list(model.parameters()), allow_unused=True)
    for mine, theirs in zip(got, oracle, strict=True):  # the last bias does not enter ∇ₓf
        theirs = torch.zeros_like(mine) if theirs is None else theirs
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-9)


def test_finite_difference_parameter_gradient_is_that_of_exact_r1_for_the_same_mask() -> None:
    """method='finite_difference' on a dropout critic, at the task's forward (SharedForward) and
    at its own: the parameter gradient is within the method's float64 error (1e-6, as without
    dropout) of the exact double backward of the forward with the same mask. Before the
    shifted forward replayed the mask, it was 30 times off."""
    model, x = critic(), batch(32).requires_grad_()
    exact, fd = make_penalty("r1"), make_penalty("r1", method="finite_difference")

    def relative_error(a: Tensor, b: Tensor) -> float:
        return float((a - b).norm() / b.norm())

    torch.manual_seed(5)
    exact_value, exact_grad = value_and_grad(exact, model, model(x), x)
    torch.manual_seed(5)
    value, grad = value_and_grad(fd, model, SharedForward.run(model, x), x)
    torch.testing.assert_close(value, exact_value)
    assert relative_error(grad, exact_grad) < 1e-6
    torch.manual_seed(5)
    value, grad = value_and_grad(fd, model, model, x)  # the penalty's own forward
    torch.testing.assert_close(value, exact_value)
    assert relative_error(grad, exact_grad) < 1e-6


def masked_generator(model: nn.Sequential, state: Tensor, z: Tensor) -> nn.Module:
    """``model`` (Linear, Tanh, Dropout, Linear) with the dropout mask of its forward from
    ``state`` written in: a deterministic function."""
    masks = []
    hook = model[2].register_forward_hook(lambda _, args, out: masks.append(out / args[0]))
    forward_from(state, model, z)
    hook.remove()
    mask = masks[0].detach()

    def fixed(q: Tensor) -> Tensor:
        return model[3](model[1](model[0](q)) * mask)
    return fixed


@pytest.mark.parametrize(("method", "epsilon", "rtol"),
                         [("double_backward", 0.1, 1e-10), ("finite_difference", 1e-3, 1e-4)])
def test_hessian_penalty_with_dropout_is_that_of_the_masked_generator(
        method: str, epsilon: float, rtol: float) -> None:
    """The Hessian penalty of a dropout generator equals the exact penalty of the same generator
    with its first forward's mask fixed (the same directions); the finite difference to its
    O(ε²). Without the replay each shifted forward (or each direction's JVP) drew its own mask."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3))
    model = model.to(F64).train()
    z = batch(5, 2)
    directions = rademacher((3, *z.shape), like=z, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(6)
    state = torch.get_rng_state()
    value = hessian_penalty(model, z, count=3, method=method, step=epsilon, reduction="mean",
                            directions=directions)
    fixed = masked_generator(model, state, z)
    expected = hessian_penalty(fixed, z, count=3, method="double_backward", reduction="mean",
                               directions=directions)
    assert expected > 1e-4
    torch.testing.assert_close(value, expected, rtol=rtol, atol=0)


def test_hessian_kind_replays_the_mask_and_its_probe_moves_no_generator() -> None:
    """kind='hessian' through a GradientPenalty (its first call probes the samples' coupling
    with a forward of its own): the same value as hessian_penalty from the same random state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3))
    model = model.to(F64).train()
    z = batch(5, 2)
    torch.manual_seed(7)
    value = make_penalty("hessian", method="double_backward")(model, z)
    torch.manual_seed(7)
    expected = hessian_penalty(model, z, count=2, method="double_backward")
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=0)


def test_spectral_norm_with_dropout_is_that_of_the_masked_jacobian() -> None:
    """Power iteration's VJP and JVPs all see the first forward's mask: σ̂ᵢ equals the largest
    singular value of each sample's Jacobian of the masked network (SVD)."""
    model, x = critic(n_out=2), batch()
    torch.manual_seed(8)
    state = torch.get_rng_state()
    sigma = spectral_norms(model, x, iterations=200,
                           generator=torch.Generator().manual_seed(3))
    fixed = masked_generator(nn.Sequential(nn.Sequential(model[0], model[1], model[2]),
                                           nn.Identity(), model[3], model[4]), state, x)
    jacobian = torch.autograd.functional.jacobian(lambda q: fixed(q).sum(0), x)  # [2, B, 3]
    expected = torch.linalg.matrix_norm(jacobian.permute(1, 0, 2), ord=2)
    torch.testing.assert_close(sigma.detach(), expected, rtol=1e-8, atol=0)


def test_exact_double_backward_with_dropout_is_that_of_the_masked_network() -> None:
    """The exact path reuses the one forward: R1 and its parameter gradient equal those of the
    network with that forward's mask written in."""
    model, x = critic(), batch().requires_grad_()
    torch.manual_seed(9)
    state = torch.get_rng_state()
    value, grad = value_and_grad(make_penalty("r1"), model, model(x), x)
    fixed = masked_generator(nn.Sequential(nn.Sequential(model[0][0], model[0][1],
                                                         model[0][2]),
                                           nn.Identity(), model[0][3], model[0][4]), state, x)
    expected_value, expected_grad = value_and_grad(make_penalty("r1"), model,
                                                   fixed(x).flatten(), x)
    torch.testing.assert_close(value, expected_value, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)


def test_subsample_with_dropout_is_the_exact_penalty_of_the_subsamples_forward() -> None:
    """A subsample runs one forward of its own (one draw for its samples): exact for it."""
    model, x = critic(), batch(8).requires_grad_()
    torch.manual_seed(10)
    state = torch.get_rng_state()
    value, grad = value_and_grad(make_penalty("r1", subsample=0.5), model, model, x)
    q, out = forward_from(state, model, x[:4])
    expected_value, expected_grad = value_and_grad(make_penalty("r1"), model, out, q)
    torch.testing.assert_close(value, expected_value, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)


def test_chunks_refuse_a_model_that_draws_random_numbers() -> None:
    """Each micro-batch's forward would draw other masks than the batch's: refused with the
    fix; in eval mode the chunked penalty is the exact one."""
    model, x = critic(), batch(8).requires_grad_()
    with pytest.raises(GradientError, match=r"chunks=2 .* draws random numbers .* eval mode"):
        make_penalty("r1", chunks=2)(model, x)
    model.eval()
    value, grad = value_and_grad(make_penalty("r1", chunks=2), model, model, x)
    expected_value, expected_grad = value_and_grad(make_penalty("r1"), model, model(x), x)
    torch.testing.assert_close(value, expected_value, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)


def test_outputs_shared_without_their_random_state_are_refused_with_a_random_model() -> None:
    """A plain callable handing back the task's outputs, or a SharedForward without a state:
    the mask of that forward cannot be replayed, so a model that draws is refused, naming
    SharedForward; a deterministic model shares as before."""
    model, x = critic(), batch()
    outputs = model(x)
    plain = lambda q: outputs if q is x else model(q)  # noqa: E731
    for fn in (plain, SharedForward(model, x, outputs, None)):
        with pytest.raises(GradientError, match="random state .* SharedForward"):
            make_penalty("approx_r1")(fn, x)
    with pytest.raises(GradientError, match="random state .* SharedForward"):
        perturbation_sq_norms(model, x, outputs=outputs)
    model.eval()
    outputs = model(x)
    plain = lambda q: outputs if q is x else model(q)  # noqa: E731
    torch.manual_seed(11)
    shared = make_penalty("approx_r1")(plain, x)
    torch.manual_seed(11)
    torch.testing.assert_close(shared, make_penalty("approx_r1")(model, x), rtol=0, atol=0)


def test_the_generators_advance_as_for_one_forward() -> None:
    """After a call the global generator stands where one forward and the probes leave it: the
    replayed forwards draw inside a fork, so the next step draws new masks."""
    model, x = critic(), batch()
    torch.manual_seed(12)
    perturbation_sq_norms(model, x, count=3, check_samples=False)
    after = torch.get_rng_state()
    torch.manual_seed(12)
    model(x)
    for _ in range(3):
        torch.randn(x.shape, dtype=torch.float32)
    assert torch.equal(after, torch.get_rng_state())


def test_random_state_capture_and_replay() -> None:
    """GeneratorState: moved() says whether the generators drew; replayed() draws the same numbers
    and restores the generators."""
    state = GeneratorState.capture(torch.zeros(1))
    assert not state.moved()
    first = torch.rand(4)
    assert state.moved()
    with state.replayed():
        again = torch.rand(4)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert not torch.equal(torch.rand(4), first)


@pytest.mark.cuda
def test_perturbation_replays_cuda_dropout() -> None:
    """The CUDA generator is captured and replayed too (the points' device)."""
    model, x = critic().cuda(), batch().cuda()
    torch.manual_seed(13)
    cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state()
    estimate = perturbation_sq_norms(model, x, step=1e-7)
    torch.cuda.set_rng_state(gpu)
    g, _ = probe_after(cpu, model, x)
    eps = torch.randn(x.shape, dtype=torch.float32, device="cuda").to(F64)
    torch.testing.assert_close(estimate, (eps * g).sum(1).square().detach(), rtol=1e-5, atol=0)


def test_over_many_masks_approx_r1_is_unbiased_for_exact_r1() -> None:
    """Over 300 draws of the mask (and one probe each), the mean of approx_r1 − R1, both of the
    same shared forward, is zero within four standard errors (a perturbed forward that drew
    another mask would put it far from zero)."""
    model, x = critic(), batch(16).requires_grad_()
    approx, exact = make_penalty("approx_r1", step=1e-4), make_penalty("r1")
    torch.manual_seed(14)
    differences, values = [], []
    for _ in range(300):
        shared = SharedForward.run(model, x)
        r1 = exact(shared.outputs, x).detach()
        differences.append(approx(shared, x).detach() - r1)
        values.append(r1)
    differences = torch.stack(differences)
    standard_error = differences.std() / len(differences) ** 0.5
    assert standard_error < 0.2 * torch.stack(values).mean()
    assert differences.mean().abs() < 4 * standard_error
