"""Parameter penalties by a shift of the parameters (SAM, GNP and GR by finite difference) where a
forward at the shifted parameters could silently run at the unshifted ones or leave a trace:
autocast's weight cache, BatchNorm's buffers in the sum form, parameters the loss does not use,
a GradScaler; each against a reference written here (the hand-written two-pass step, or the
same step in float64)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradreg.penalties import (
    LossAt,
    accumulated_backward,
    gr,
    param_grad_norm,
    penalized_backward,
    penalized_loss,
    sam,
)

RHO = 0.05


def classifier(*layers: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), *layers, nn.Tanh(), nn.Linear(32, 3)).to(dtype)


def batch(dtype: torch.dtype = torch.float32, rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(rows, 8, dtype=dtype, generator=generator),
            torch.randint(0, 3, (rows,), generator=generator))


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b, strict=True))


def sam_by_hand(model: nn.Module, loss_fn, rho: float) -> list[torch.Tensor]:
    """SAM's gradient ∇L(θ + ρ g/‖g‖), each forward in an autocast block of its own (so that no
    cast is shared between the two points)."""
    params = list(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = torch.autograd.grad(loss_fn(), params)
    norm = torch.linalg.vector_norm(torch.stack([t.norm() for t in g]))
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, t in zip(params, g, strict=True):
            p.add_(t * (rho / norm))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        shifted = torch.autograd.grad(loss_fn(), params)
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    return list(shifted)


@pytest.mark.parametrize("form", ["penalized_backward", "penalized_loss", "sum"])
def test_sam_under_autocast_runs_the_shifted_pass_at_the_shifted_parameters(form: str) -> None:
    """Autocast keeps its bf16 casts of the weights for the whole block: the shifted forward
    must not reuse the casts of θ (it would return the plain gradient, 9.3e-3 from SAM's here)."""
    model = classifier()
    x, y = batch()
    params = list(model.parameters())

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    expected = sam_by_hand(model, loss_fn, RHO)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn().backward()
    plain = grads_of(model)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        at = LossAt.run(loss_fn, x)
        if form == "penalized_backward":
            penalized_backward(sam(RHO), at, params)
        elif form == "penalized_loss":
            sum(penalized_loss(sam(RHO), at, params)).backward()
        else:
            (at.loss + sam(RHO)(at, params)).backward()
    got = grads_of(model)
    assert largest_difference(plain, expected) > 1e-3  # SAM's step is not the plain one here
    assert largest_difference(got, expected) <= 1e-6 * max(t.abs().max().item() for t in expected)
    # a forward after the step, in the same block, runs at θ again (the shifted casts dropped)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        at = LossAt.run(loss_fn, x)
        penalized_backward(sam(RHO), at, params)
        after = loss_fn()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(after, loss_fn())


def test_gnp_under_autocast_keeps_its_penalty_gradient() -> None:
    """GNP by finite difference under bf16 autocast: its gradient is ∇L + λ H ĝ, whose penalty
    part is the difference of the gradients at θ + r ĝ and θ over r: within bf16's error of the
    float32 step (and not the plain gradient, which autocast's cache used to give)."""
    model = classifier()
    x, y = batch()
    params = list(model.parameters())
    gnp = param_grad_norm(0.5, method="finite_difference", step=0.05)

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    penalized_backward(gnp, LossAt.run(loss_fn, x), params)
    full = grads_of(model)
    model.zero_grad()
    loss_fn().backward()
    plain = grads_of(model)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        penalized_backward(gnp, LossAt.run(loss_fn, x), params)
    half = grads_of(model)
    penalty_part = largest_difference(full, plain)
    assert penalty_part > 1e-2
    assert largest_difference(half, full) < 0.1 * penalty_part


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("make", [lambda: sam(RHO), lambda: gr(0.1, step=1e-3),
                                  lambda: param_grad_norm(0.1, method="finite_difference",
                                                          step=1e-4)],
                         ids=["sam", "gr", "gnp"])
def test_sum_form_with_batchnorm_equals_the_two_pass_form(training: bool, make) -> None:
    """``(at.loss + penalty(at, params)).backward()`` with BatchNorm (its graph saved the
    running statistics, which the shifted forward must not touch): the gradient of the two-pass
    form, and the running statistics of one forward."""
    model = classifier(nn.BatchNorm1d(32), dtype=torch.float64).train(training)
    x, y = batch(torch.float64)
    twin = copy.deepcopy(model)

    def step(net: nn.Module, sum_form: bool) -> list[torch.Tensor]:
        params = list(net.parameters())
        at = LossAt.run(lambda: F.cross_entropy(net(x), y), x)
        if sum_form:
            (at.loss + make()(at, params)).backward()
        else:
            penalized_backward(make(), at, params)
        return grads_of(net)

    got, expected = step(model, True), step(twin, False)
    assert largest_difference(got, expected) <= 1e-12
    bn, bn_twin = model[1], twin[1]
    assert torch.equal(bn.running_mean, bn_twin.running_mean)
    assert torch.equal(bn.running_var, bn_twin.running_var)
    assert int(bn.num_batches_tracked) == (1 if training else 0)


class WithSpare(nn.Module):
    """A classifier with a head its loss does not use."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.spare = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("form", ["penalized_backward", "penalized_loss", "sum",
                                  "accumulated_backward"])
def test_unused_parameters_keep_grad_none(form: str) -> None:
    """A parameter the loss does not use keeps ``.grad`` None, as after ``backward`` (a zero
    would make AdamW move it by its weight decay); the others get the step's gradient."""
    model = WithSpare().double()
    x, y = batch(torch.float64)
    params = list(model.parameters())
    gnp = param_grad_norm(0.1, method="finite_difference", step=1e-4)

    def loss_fn(rows: slice = slice(None)) -> torch.Tensor:
        return F.cross_entropy(model(x[rows]), y[rows])

    at = LossAt.run(loss_fn, x)
    if form == "penalized_backward":
        penalized_backward(gnp, at, params)
    elif form == "penalized_loss":
        sum(penalized_loss(gnp, at, params)).backward()
    elif form == "sum":
        (at.loss + gnp(at, params)).backward()
    else:
        accumulated_backward(gnp, [lambda: loss_fn(slice(0, 32)), lambda: loss_fn(slice(32, 64))],
                             params, on=(x,), rows=[32, 32])
    assert model.spare.weight.grad is None and model.spare.bias.grad is None
    assert all(p.grad is not None for p in model.body.parameters())
    decay = torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)
    before = model.spare.weight.detach().clone()
    decay.step()
    assert torch.equal(model.spare.weight, before)


def test_penalized_backward_takes_a_grad_scaler() -> None:
    """``scale=scaler``: the gradient times the scaler's scale (2**16, no host sync), and
    ``scaler.step`` then takes the unscaled step (it refused a scaler never used before)."""
    model = classifier(dtype=torch.float32)
    twin = copy.deepcopy(model)
    x, y = batch()
    gnp = param_grad_norm(0.1, method="finite_difference", step=1e-3)

    def run(net: nn.Module, scale) -> None:
        penalized_backward(gnp, LossAt.run(lambda: F.cross_entropy(net(x), y), x),
                           list(net.parameters()), scale=scale)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    run(model, scaler)
    run(twin, None)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad * 2.0**16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = [p.detach() - 0.1 * q.grad for p, q in
                zip(model.parameters(), twin.parameters(), strict=True)]
    scaler.step(optimizer)
    scaler.update()
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=2.0**-22, atol=1e-9)  # one rounding of p


@pytest.mark.parametrize("method", ["finite_difference", "double_backward"])
def test_unequal_micro_batches_are_weighted_by_their_samples(method: str) -> None:
    """Micro-batches of 4 and 12 rows: the step of the one batch of 16 (float64, to float
    rounding); weighted equally (as halves) the step would be another one."""
    options = {"step": 1e-5} if method == "finite_difference" else {}
    model = classifier(dtype=torch.float64)
    x, y = batch(torch.float64, rows=16)
    params = list(model.parameters())

    def loss_fn(rows: slice = slice(None)) -> torch.Tensor:
        return F.cross_entropy(model(x[rows]), y[rows])

    def step(rows: list[int], parts: list) -> tuple[list[torch.Tensor], torch.Tensor]:
        model.zero_grad()
        _, value = accumulated_backward(param_grad_norm(0.5, method=method, **options), parts,
                                        params, rows=rows, on=(x,))
        return grads_of(model), value

    whole, whole_value = step([16], [loss_fn])
    parts = [lambda: loss_fn(slice(0, 4)), lambda: loss_fn(slice(4, 16))]
    weighted, value = step([4, 12], parts)
    as_halves, _ = step([1, 1], parts)
    scale = max(t.abs().max().item() for t in whole)
    assert largest_difference(weighted, whole) <= 1e-9 * scale
    torch.testing.assert_close(value, whole_value, rtol=1e-12, atol=0)
    assert largest_difference(as_halves, whole) > 1e-2 * scale


def test_accumulated_backward_refuses_what_it_cannot_weight() -> None:
    """More than one micro-batch without their sizes, sizes that do not fit, and a loss computed
    without grad: each refused in one line naming the fix, ``.grad`` untouched."""
    from gradreg import GradientError

    model = classifier(dtype=torch.float64)
    x, y = batch(torch.float64, rows=16)
    params = list(model.parameters())

    def loss_fn(rows: slice = slice(None)) -> torch.Tensor:
        return F.cross_entropy(model(x[rows]), y[rows])

    parts = [lambda: loss_fn(slice(0, 4)), lambda: loss_fn(slice(4, 16))]
    gnp = param_grad_norm(0.5, method="finite_difference")
    with pytest.raises(GradientError, match=r"needs rows=\[\.\.\.\], the number of samples"):
        accumulated_backward(gnp, parts, params, on=(x,))
    with pytest.raises(GradientError, match=r"rows=\[4\] must give a positive number of samples "
                                            r"for each of the 2 micro-batches"):
        accumulated_backward(gnp, parts, params, rows=[4], on=(x,))

    def without_grad() -> torch.Tensor:
        with torch.no_grad():
            return loss_fn()

    with pytest.raises(GradientError, match="micro-batch 0's loss does not require grad"):
        accumulated_backward(gnp, [without_grad], params, on=(x,))
    assert all(p.grad is None for p in params)


class Noisy(nn.Module):
    """A classifier whose forward masks its hidden units with draws from ``source``: Python's
    ``random``, NumPy's global generator, a ``torch.Generator`` of its own, or torch's."""

    def __init__(self, source: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.source = source
        self.generator = torch.Generator().manual_seed(5)
        self.first, self.last = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        shape = hidden.shape
        if self.source == "python":
            import random

            keep = torch.tensor([random.random() > 0.3 for _ in range(hidden.numel())])
        elif self.source == "numpy":
            import numpy

            keep = torch.from_numpy(numpy.random.rand(hidden.numel()) > 0.3)
        elif self.source == "generator":
            keep = torch.rand(hidden.numel(), generator=self.generator) > 0.3
        else:
            keep = torch.rand(hidden.numel()) > 0.3
        return self.last(hidden * keep.reshape(shape).to(hidden.dtype) / 0.7)


@pytest.mark.parametrize(("source", "named"), [
    ("generator", r"a torch.Generator of its own \(rand given generator=\)"),
    ("python", "Python's random"), ("numpy", r"numpy\.random")])
@pytest.mark.parametrize("form", ["penalized_backward", "accumulated_backward"])
def test_draws_no_captured_state_replays_are_refused(source: str, named: str, form: str) -> None:
    """A forward drawing from a ``torch.Generator`` of its own, Python's ``random`` or NumPy's
    global generator cannot draw the same numbers at the shifted parameters (GNP by finite
    difference was 1.8e4-6.8e4 off): refused on the first call in one line naming the source and
    the fix, ``.grad`` untouched; the same model drawing from torch's generator is taken."""
    from gradreg import GradientError

    if source == "numpy":
        pytest.importorskip("numpy")
    model = Noisy(source).double()
    x, y = batch(torch.float64, rows=16)
    params = list(model.parameters())

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    with pytest.raises(GradientError, match=f"draws from {named}, which no captured state "
                                            r"replays.*method='double_backward'"):
        if form == "penalized_backward":
            penalized_backward(sam(RHO), LossAt.run(loss_fn, x), params)
        else:
            accumulated_backward(sam(RHO), [loss_fn], params, on=(x,))
    assert all(p.grad is None for p in params)


def test_draws_of_torchs_generator_are_replayed() -> None:
    """The same mask from torch's global generator: GNP by finite difference (step 1e-6) is the
    exact gradient of the same masked loss (double backward, seeded alike) to 1e-6."""
    model = Noisy("torch").double()
    x, y = batch(torch.float64, rows=16)
    params = list(model.parameters())

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    torch.manual_seed(3)
    penalized_backward(param_grad_norm(0.5, method="finite_difference", step=1e-6),
                       LossAt.run(loss_fn, x), params)
    estimate = grads_of(model)
    model.zero_grad()
    torch.manual_seed(3)
    loss = loss_fn()
    (loss + param_grad_norm(0.5)(loss, params)).backward()
    exact = grads_of(model)
    assert largest_difference(estimate, exact) <= 1e-6 * max(t.abs().max().item() for t in exact)


def relu_transformer_critic() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation="relu",
                                       batch_first=True)
    critic = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                           nn.Flatten(), nn.Linear(16 * 6, 1))
    return critic, torch.randn(32, 6, 16)


def test_gnp_default_step_on_a_piecewise_linear_model_is_refused() -> None:
    """GNP by finite difference stands in for the exact gradient; on a ReLU transformer encoder
    (float32) its default step (1e-3) is 13.7% from it (double backward), step 1e-4 0.018%:
    the default is refused in one line, a step given is taken (the objective chosen)."""
    import gradreg
    from gradreg import GradientError

    critic, x = relu_transformer_critic()
    params = list(critic.parameters())

    def loss_fn() -> torch.Tensor:
        return critic(x).mean()

    with gradreg.differentiable_attention():
        loss = loss_fn()
        (loss + param_grad_norm(0.1)(loss, params)).backward()
    exact = torch.cat([p.grad.flatten() for p in params])
    errors = {}
    for step in (1e-3, 1e-4):
        critic.zero_grad()
        penalized_backward(param_grad_norm(0.1, method="finite_difference", step=step),
                           LossAt.run(loss_fn, x), params)
        estimate = torch.cat([p.grad.flatten() for p in params])
        errors[step] = ((estimate - exact).norm() / exact.norm()).item()
    assert errors[1e-3] > 0.05 and errors[1e-4] < 1e-3
    critic.zero_grad()
    for run in (lambda gnp: penalized_backward(gnp, LossAt.run(loss_fn, x), params),
                lambda gnp: accumulated_backward(gnp, [loss_fn], params, on=(x,))):
        with pytest.raises(GradientError, match=r"at its default step on a piecewise-linear model "
                                                r"\(Relu in its graph\).*method='double_backward'"):
            run(param_grad_norm(0.1, method="finite_difference"))
    assert all(p.grad is None for p in params)
    penalized_backward(sam(RHO), LossAt.run(loss_fn, x), params)  # SAM: defined by its shift
    assert all(p.grad is not None for p in params)


@pytest.mark.parametrize("make", [lambda: sam(RHO), lambda: param_grad_norm(0.1)],
                         ids=["two_passes", "double_backward"])
def test_a_loss_at_given_twice_is_refused(make) -> None:
    """One ``LossAt`` (one step's loss, its graph freed by the first call) given to a second
    ``penalized_backward``: refused in one line naming the fix; the first call's ``.grad`` kept."""
    from gradreg import GradientError

    model = classifier()
    x, y = batch()
    params = list(model.parameters())
    at = LossAt.run(lambda: F.cross_entropy(model(x), y), x)
    penalized_backward(make(), at, params)
    first = grads_of(model)
    with pytest.raises(GradientError, match="was given a LossAt whose loss an earlier call "
                                            r"differentiated and freed.*LossAt.run\(loss_fn, x\)"):
        penalized_backward(make(), at, params)
    assert largest_difference(grads_of(model), first) == 0.0
