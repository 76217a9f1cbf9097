"""Parameter-gradient penalties at the two-pass cost (:func:`penalized_loss`,
:func:`penalized_backward`), SAM as a preset,
and the penalty of an accumulated batch (:func:`accumulated_backward`), against references
written here, in float64."""

from __future__ import annotations

import copy
from functools import partial
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradreg import GradientError
from gradreg.penalties import asam, gr, param_grad_norm, sam
from gradreg.penalties.accumulation import accumulated_backward
from gradreg.penalties.call import TaskGradient
from gradreg.penalties.methods.param_gradient import LossAt
from gradreg.penalties.two_pass import penalized_backward, penalized_loss

WEIGHT, STEP = 0.5, 1e-4


class Passes(torch.autograd.Function):
    """The identity, counting the forwards and backwards through it."""

    count: ClassVar[dict[str, int]] = {"forward": 0, "backward": 0}

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        Passes.count["forward"] += 1
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        Passes.count["backward"] += 1
        return g


class Counted(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Passes.apply(x)


def problem(dropout: float = 0.0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), Counted(), nn.Tanh(), nn.Dropout(dropout),
                          nn.Linear(16, 3)).double()
    return model, torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def grads(model: nn.Module) -> torch.Tensor:
    return flat([p.grad for p in model.parameters()])


@pytest.mark.parametrize("split", [False, True])
def test_penalized_loss_is_the_plain_form_in_two_passes(split: bool) -> None:
    """The same values and gradient as ``loss + penalty(LossAt(fn, loss), params)`` (float
    rounding), two forwards and two backwards where that takes three backwards."""
    model, x, y = problem()
    params = list(model.parameters())

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    Passes.count.update(forward=0, backward=0)
    at = LossAt.run(loss_fn, x)
    plain_value = param_grad_norm(WEIGHT, method="finite_difference", step=STEP)(at, params)
    (at.loss + plain_value).backward()
    plain = grads(model)
    assert Passes.count == {"forward": 2, "backward": 3}
    model.zero_grad()
    Passes.count.update(forward=0, backward=0)
    gnp = param_grad_norm(WEIGHT, method="finite_difference", step=STEP)
    task, value = penalized_loss(gnp, LossAt.run(loss_fn, x), params, split=split)
    (task + value).backward()
    assert Passes.count == {"forward": 2, "backward": 2}
    torch.testing.assert_close(grads(model), plain, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(task, at.loss.detach(), rtol=0, atol=0)
    torch.testing.assert_close(value, plain_value.detach(), rtol=0, atol=0)
    if split:  # each term carries its own part: the task's gradient alone
        model.zero_grad()
        task, value = penalized_loss(gnp, LossAt.run(loss_fn, x), params, split=True)
        task.backward()
        expected = flat(torch.autograd.grad(loss_fn(), params))
        torch.testing.assert_close(grads(model), expected, rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("split", [False, True])
def test_the_task_gradient_is_returned_and_the_loss_at_is_left_as_given(split: bool) -> None:
    """``penalty(at, params, task=TaskGradient(...))`` returns ``(weighted value, gradient)``:
    :math:`g + c\\,Hv` (by hand: the plain form's gradient), or :math:`g` with ``split``;
    nothing is written on the :class:`LossAt`."""
    model, x, y = problem()
    params = list(model.parameters())

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    gnp = param_grad_norm(WEIGHT, method="finite_difference", step=STEP)
    at = LossAt.run(loss_fn, x)
    plain = flat(torch.autograd.grad(at.loss + gnp(at, params), params))
    at = LossAt.run(loss_fn, x)
    before = dict(vars(at))
    value, gradient = gnp(at, params, task=TaskGradient(gnp.factor, split=split))
    assert vars(at).keys() == before.keys()
    if split:  # g alone; the value carries c H v
        torch.testing.assert_close(flat(gradient), flat(torch.autograd.grad(loss_fn(), params)),
                                   rtol=1e-14, atol=1e-16)
        assert value.requires_grad
    else:
        torch.testing.assert_close(flat(gradient), plain, rtol=1e-12, atol=1e-15)
        assert not value.requires_grad
    exact = param_grad_norm(WEIGHT)
    torch.testing.assert_close(value.detach(), exact(loss_fn(), params).detach(),
                               rtol=1e-12, atol=0)


def test_a_task_request_to_double_backward_returns_no_gradient() -> None:
    """Double backward takes no task gradient: None, the value carrying its own."""
    model, x, y = problem()
    params = list(model.parameters())
    loss = F.cross_entropy(model(x), y)
    value, gradient = param_grad_norm(WEIGHT)(loss, params, task=TaskGradient(WEIGHT))
    assert gradient is None and value.requires_grad


def test_penalized_loss_by_double_backward_is_the_exact_penalty() -> None:
    model, x, y = problem()
    params = list(model.parameters())
    loss = F.cross_entropy(model(x), y)
    exact = flat(torch.autograd.grad(loss + param_grad_norm(WEIGHT)(loss, params), params))
    task, value = penalized_loss(param_grad_norm(WEIGHT),
                                 LossAt.run(lambda: F.cross_entropy(model(x), y), x), params)
    torch.testing.assert_close(flat(torch.autograd.grad(task + value, params)), exact,
                               rtol=1e-14, atol=1e-16)


def test_penalized_loss_refuses_a_penalty_on_other_points() -> None:
    from gradreg.penalties import r1

    model, x, y = problem()
    with pytest.raises(GradientError, match="points='parameters', got points='real'"):
        penalized_loss(r1(), LossAt(lambda: F.cross_entropy(model(x), y)),
                       list(model.parameters()))


def exact_step_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∇θ(L + WEIGHT ||∇θ L||) by double backward: the oracle of the finite difference."""
    params = list(model.parameters())
    loss = F.cross_entropy(model(x), y)
    return flat(torch.autograd.grad(loss + param_grad_norm(WEIGHT)(loss, params), params))


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_penalized_backward_fills_grad_as_the_backward_of_penalized_loss(dropout: float) -> None:
    """``.grad`` equals that of ``(task + value).backward()`` bitwise, with dropout (its mask
    replayed), in two forwards and two backwards, and added to a ``.grad`` already there; and
    equals the exact step gradient (double backward, dropout off) to the difference's
    truncation."""
    model, x, y = problem(dropout)
    params = list(model.parameters())

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    gnp = param_grad_norm(WEIGHT, method="finite_difference", step=STEP)
    torch.manual_seed(1)
    task, value = penalized_loss(gnp, LossAt.run(loss_fn, x), params)
    (task + value).backward()
    expected = grads(model)
    model.zero_grad()
    Passes.count.update(forward=0, backward=0)
    torch.manual_seed(1)
    loss, penalty = penalized_backward(gnp, LossAt.run(loss_fn, x), params)
    assert Passes.count == {"forward": 2, "backward": 2}
    assert torch.equal(grads(model), expected)
    assert (loss.item(), penalty.item()) == (task.item(), value.item())
    assert not loss.requires_grad and not penalty.requires_grad
    torch.manual_seed(1)
    penalized_backward(gnp, LossAt.run(loss_fn, x), params)  # accumulates, as backward does
    torch.testing.assert_close(grads(model), 2 * expected, rtol=1e-15, atol=0)
    if dropout == 0.0:
        exact = exact_step_gradient(model, x, y)
        assert ((expected - exact).norm() / exact.norm()).item() < 1e-4  # 2e-5: O(STEP)


def test_penalized_backward_scales_the_step_gradient() -> None:
    """``scale=s`` (a float or a tensor: a GradScaler's scale, 1/k for k micro-batches) adds
    s times the gradient; by double backward the backward of s (L + c P)."""
    model, x, y = problem()
    params = list(model.parameters())

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    gnp = param_grad_norm(WEIGHT, method="finite_difference", step=STEP)
    penalized_backward(gnp, LossAt.run(loss_fn, x), params)
    once = grads(model)
    for scale in (0.25, torch.tensor(0.25, dtype=torch.float64)):
        model.zero_grad()
        penalized_backward(gnp, LossAt.run(loss_fn, x), params, scale=scale)
        torch.testing.assert_close(grads(model), 0.25 * once, rtol=1e-15, atol=0)
    model.zero_grad()
    loss, penalty = penalized_backward(param_grad_norm(WEIGHT), LossAt.run(loss_fn, x), params,
                                       scale=4.0)
    assert loss.item() == loss_fn().item()
    torch.testing.assert_close(grads(model), 4 * exact_step_gradient(model, x, y), rtol=1e-14,
                               atol=1e-16)
    assert not penalty.requires_grad


def test_penalized_backward_goes_through_autograd_where_a_hook_watches_grad() -> None:
    """A parameter's tensor hook and post-accumulate hook see the gradient, as after a
    backward (the gradient is accumulated by autograd, not written to ``.grad``)."""
    model, x, y = problem()
    params = list(model.parameters())
    seen: dict[str, list[torch.Tensor]] = {"hook": [], "accumulated": []}
    params[0].register_hook(lambda g: seen["hook"].append(g.clone()))
    params[0].register_post_accumulate_grad_hook(
        lambda p: seen["accumulated"].append(p.grad.clone()))
    gnp = param_grad_norm(WEIGHT, method="finite_difference", step=STEP)

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    penalized_backward(gnp, LossAt.run(loss_fn, x), params)
    # the tensor hook sees the gradients at θ and at the shifted θ too, as penalized_loss's
    # backward makes it see them; the accumulation, once
    assert len(seen["hook"]) == 3 and torch.equal(seen["hook"][-1], params[0].grad)
    assert len(seen["accumulated"]) == 1 and torch.equal(seen["accumulated"][0], params[0].grad)
    expected = copy.deepcopy(model)
    task, value = penalized_loss(gnp, LossAt.run(lambda: F.cross_entropy(expected(x), y), x),
                                 list(expected.parameters()))
    (task + value).backward()
    assert torch.equal(grads(model), grads(expected))


def test_penalized_backward_goes_through_autograd_under_a_process_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a ``torch.distributed`` group initialized (DDP's reducer hooks the accumulation),
    the gradient is accumulated by ``torch.autograd.backward`` of the parameters."""
    model, x, y = problem()
    params = list(model.parameters())
    calls = []
    backward = torch.autograd.backward
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.autograd, "backward",
                        lambda tensors, grads: calls.append(len(tensors)) or backward(tensors,
                                                                                       grads))
    gnp = param_grad_norm(WEIGHT, method="finite_difference", step=STEP)
    penalized_backward(gnp, LossAt.run(lambda: F.cross_entropy(model(x), y), x), params)
    assert calls == [len(params)]
    assert all(p.grad is not None for p in params)


def test_penalized_backward_under_float16_autocast_needs_the_scale() -> None:
    model, x, y = problem()
    model.float()
    gnp = param_grad_norm(WEIGHT, method="finite_difference", step=1e-2)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(
            GradientError, match=r"pass scale=scaler \(the GradScaler\) \(scale=1.0 where no "):
        penalized_backward(gnp, LossAt(lambda: F.cross_entropy(model(x.float()), y)),
                           list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_penalized_backward_refuses_a_penalty_on_other_points() -> None:
    from gradreg.penalties import r1

    model, x, y = problem()
    with pytest.raises(GradientError, match="penalized_backward takes a penalty on "
                                            "points='parameters'"):
        penalized_backward(r1(), LossAt(lambda: F.cross_entropy(model(x), y)),
                           list(model.parameters()))


def davda54_sam(model: nn.Module, loss_fn: partial, rho: float, *, adaptive: bool = False,
                offset: float = 1e-12) -> torch.Tensor:
    """SAM's two steps as davda54/sam writes them: e = rho T² g / (||T g|| + ``offset``)
    (T = |θ| with ``adaptive``, ASAM; 1 otherwise), the gradient at θ + e."""
    loss_fn().backward()
    params = list(model.parameters())
    norm = torch.norm(torch.stack([((p.abs() if adaptive else 1.0) * p.grad).norm(2)
                                   for p in params]), 2)
    shifts = []
    with torch.no_grad():
        for p in params:
            e = (p.pow(2) if adaptive else 1.0) * p.grad * (rho / (norm + offset))
            p.add_(e)
            shifts.append(e)
    model.zero_grad()
    loss_fn().backward()
    with torch.no_grad():
        for p, e in zip(params, shifts, strict=True):
            p.sub_(e)
    return grads(model)


@pytest.mark.parametrize("form", ["loss + sam", "penalized_loss"])
def test_sam_is_the_gradient_at_the_ascent_point(form: str) -> None:
    """Equal to the two-step reference to float rounding (davda54/sam adds 1e-12 to the norm:
    a relative 1e-12 on the shift)."""
    model, x, y = problem()
    loss_fn = partial(lambda: F.cross_entropy(model(x), y))
    reference = davda54_sam(model, loss_fn, 0.05)
    model.zero_grad()
    params = list(model.parameters())
    at = LossAt.run(loss_fn, x)
    if form == "penalized_loss":
        task, value = penalized_loss(sam(0.05), at, params)
        (task + value).backward()
    else:
        (at.loss + sam(0.05)(at, params)).backward()
    torch.testing.assert_close(grads(model), reference, rtol=1e-11, atol=1e-14)
    assert sam(0.05).config.step == 0.05 and sam(0.05).weight == 0.05


@pytest.mark.parametrize("form", ["loss + asam", "penalized_loss", "accumulated_backward"])
def test_asam_is_the_gradient_at_the_adaptive_ascent_point(form: str) -> None:
    """Equal to davda54/sam's two steps with ``adaptive=True`` to float rounding, without its
    offset of 1e-12 on ||T g|| (0.066 here: a relative 1.5e-11 on the shift, 1.6e-13 on the
    gradient, measured); the value is rho || |θ| g ||."""
    model, x, y = problem()
    loss_fn = partial(lambda: F.cross_entropy(model(x), y))
    params = list(model.parameters())
    g = torch.autograd.grad(loss_fn(), params)
    sharpness = 0.5 * torch.sqrt(sum((p.abs() * t).square().sum()
                                     for p, t in zip(params, g, strict=True)))
    davda54 = davda54_sam(model, loss_fn, 0.5, adaptive=True)
    model.zero_grad()
    reference = davda54_sam(model, loss_fn, 0.5, adaptive=True, offset=0.0)
    model.zero_grad()
    at = LossAt.run(loss_fn, x)
    if form == "penalized_loss":
        task, value = penalized_loss(asam(0.5), at, params)
        (task + value).backward()
    elif form == "accumulated_backward":
        _, value = accumulated_backward(asam(0.5), [loss_fn], params, on=(x,))
    else:
        value = asam(0.5)(at, params)
        (at.loss + value).backward()
    torch.testing.assert_close(grads(model), reference, rtol=1e-11, atol=1e-14)
    torch.testing.assert_close(grads(model), davda54, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(value.detach(), sharpness.detach(), rtol=1e-14, atol=0)
    model.zero_grad()  # and not SAM's
    assert (reference - davda54_sam(model, loss_fn, 0.5)).norm() > 0.1 * reference.norm()


def test_sam_with_dropout_replays_the_mask() -> None:
    """The reference seeded to draw the same mask in both of its forwards."""
    model, x, y = problem(dropout=0.3)

    def seeded() -> torch.Tensor:
        torch.manual_seed(7)
        return F.cross_entropy(model(x), y)

    reference = davda54_sam(model, seeded, 0.05)
    model.zero_grad()
    task, value = penalized_loss(sam(0.05), LossAt.run(seeded, x), list(model.parameters()))
    (task + value).backward()
    torch.testing.assert_close(grads(model), reference, rtol=1e-11, atol=1e-14)


def micro_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int) -> list[partial]:
    return [partial(lambda a, b: F.cross_entropy(model(a), b), a, b)
            for a, b in zip(x.chunk(n), y.chunk(n), strict=True)]


@pytest.mark.parametrize("method", ["finite_difference", "double_backward", "gr", "asam"])
def test_accumulated_batches_give_the_big_batch_step(method: str) -> None:
    """Two micro-batches of 8 against one batch of 16, three SGD steps: the same parameters
    within float rounding (penalizing each micro-batch's own gradient, one backward of
    ``(loss + penalty) / 2`` per micro-batch, ends 0.148 away, measured, both methods); also
    by the shift rule ``"gradient"`` (GR's ε g, with λ/ε = 50 amplifying the rounding of the
    gradients' difference less than 5000 at ε = 1e-4; ASAM's)."""
    presets = {"gr": lambda: gr(WEIGHT, step=1e-2), "asam": lambda: asam(0.05),
               "finite_difference": lambda: param_grad_norm(WEIGHT, method=method, step=STEP),
               "double_backward": lambda: param_grad_norm(WEIGHT)}
    # The batch of 16 and the two of 8 sum the same terms in another order (and the CPU's
    # vectorization, AVX2 or AVX-512, orders them again): each gradient entry is off by a few
    # eps * max|g|. A quotient of two gradients' difference by its step amplifies that by λ/step
    # (5000 for the finite difference, 50 for GR; 1 for the exact and SAM's forms), and three
    # SGD steps of lr 0.5 add 1.5 times the step gradient's error to the parameters. Allowed:
    # 16 eps for "a few" (measured 0.3-0.6 eps on AMD EPYC and Intel Xeon).
    amplification = {"finite_difference": WEIGHT / STEP, "gr": WEIGHT / 1e-2}.get(method, 1.0)
    lr, steps, largest = 0.5, 3, 0.0
    model, x, y = problem()
    big, accumulated = model, problem()[0]
    for net, micro in ((big, 1), (accumulated, 2)):
        gnp = presets[method]()
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        for _ in range(steps):
            optimizer.zero_grad()
            accumulated_backward(gnp, micro_losses(net, x, y, micro), list(net.parameters()),
                                 rows=[len(x) // micro] * micro, on=(x,))
            largest = max(largest, grads(net).abs().max().item())
            optimizer.step()
    bound = 16 * torch.finfo(torch.float64).eps * (1 + amplification) * largest * lr * steps
    torch.testing.assert_close(flat(list(accumulated.parameters())), flat(list(big.parameters())),
                               rtol=0, atol=bound)


@pytest.mark.parametrize("method", ["finite_difference", "double_backward", "gr"])
def test_one_micro_batch_is_the_plain_step(method: str) -> None:
    """Also GR at its default step (the shift rule's own default, 3e-7 in float64)."""
    make = {"finite_difference": partial(param_grad_norm, WEIGHT, method=method, step=STEP),
            "double_backward": partial(param_grad_norm, WEIGHT), "gr": partial(gr, WEIGHT)}[method]
    model, x, y = problem()
    params = list(model.parameters())
    loss_fn = partial(lambda: F.cross_entropy(model(x), y))
    at = LossAt.run(loss_fn, x) if method != "double_backward" else None
    loss = at.loss if at else loss_fn()
    plain_value = make()(at or loss, params)
    plain = flat(torch.autograd.grad(loss + plain_value, params))
    loss_value, value = accumulated_backward(make(), [loss_fn], params)
    torch.testing.assert_close(grads(model), plain, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(loss_value, loss.detach())
    torch.testing.assert_close(value, plain_value.detach(), rtol=1e-14, atol=0)


def test_accumulated_dropout_batches_replay_each_micro_batchs_mask() -> None:
    """Exact and finite difference on the same seeded micro-batches agree to O(r)."""
    model, x, y = problem(dropout=0.3)
    params = list(model.parameters())
    results = []
    for options in ({}, {"method": "finite_difference", "step": 1e-6}):
        model.zero_grad()
        torch.manual_seed(3)
        accumulated_backward(param_grad_norm(WEIGHT, **options), micro_losses(model, x, y, 2),
                             params, rows=[8, 8], on=(x,))
        results.append(grads(model))
    assert (results[1] - results[0]).norm() <= 1e-5 * results[0].norm()


def half_square(theta: torch.Tensor) -> torch.Tensor:
    return theta.square().sum() / 2


def test_at_a_stationary_point_nothing_is_shifted_and_the_gradient_is_zero() -> None:
    """g = 0 (the minimum of ‖θ‖²/2): the direction is the subgradient 0, the step's gradient
    0, finite, for the plain norm and the squared one, by either shift rule (GR, ASAM)."""
    for penalty in (sam(0.05), param_grad_norm(WEIGHT, method="finite_difference"),
                    param_grad_norm(WEIGHT, power=2.0, method="finite_difference"),
                    gr(WEIGHT), asam(0.5)):
        theta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        task, value = penalized_loss(penalty, LossAt.run(partial(half_square, theta)), [theta])
        (task + value).backward()
        assert value.item() == 0 and torch.equal(theta.grad, torch.zeros(3, dtype=torch.float64))


def gr_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **options: object
                ) -> torch.Tensor:
    """The parameter gradient of GR's penalty alone, ``gr(1)`` in the plain form, flat."""
    params = list(model.parameters())
    at = LossAt.run(lambda: F.cross_entropy(model(x), y), x)
    value = gr(1.0, **options)(at, params)
    return torch.cat([g.flatten() for g in torch.autograd.grad(value, params)])


def test_gr_default_step_is_a_fraction_of_the_parameter_step_and_below_one_percent() -> None:
    """GR's default ε is 0.3 of the normalized shift's default length: 3e-4 in float32 and 3e-7
    in float64 (bitwise the estimates of those steps); against float64 double backward of
    ½‖g‖² (H g), the float32 estimate of a tanh MLP (‖g‖ = 0.24) is 0.26% off (their ε =
    1e-3: 0.08% here, 1.6% on the docs' transformer, whose ‖g‖ is 3.3)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4))
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    model64 = copy.deepcopy(model).double()
    params64 = list(model64.parameters())
    g = torch.autograd.grad(F.cross_entropy(model64(x.double()), y), params64, create_graph=True)
    exact = torch.cat([h.flatten() for h in torch.autograd.grad(
        sum(t.square().sum() for t in g) / 2, params64)])
    default = gr_gradient(model, x, y)
    assert torch.equal(default, gr_gradient(model, x, y, step=3e-4))
    assert torch.equal(gr_gradient(model64, x.double(), y),
                       gr_gradient(model64, x.double(), y, step=1e-6 * 0.3))
    error = ((default.double() - exact).norm() / exact.norm()).item()
    assert error < 1e-2


@pytest.mark.parametrize("method", ["finite_difference", "double_backward"])
def test_the_accumulated_penalty_is_checked_finite(method: str) -> None:
    """A non-finite parameter makes the accumulated batch's penalty NaN: refused, as the
    penalty's own call refuses it (``check_finite=False`` lets it through)."""
    from gradreg.autograd import NonFiniteError

    model, x, y = problem()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    params = list(model.parameters())
    halves = [lambda: F.cross_entropy(model(x[:8]), y[:8]),
              lambda: F.cross_entropy(model(x[8:]), y[8:])]
    with pytest.raises(NonFiniteError, match=r"the penalty of call 1 is nan \(not finite\)"):
        accumulated_backward(param_grad_norm(WEIGHT, method=method), halves, params,
                             rows=[8, 8], on=(x,))
    model.zero_grad()
    _, value = accumulated_backward(param_grad_norm(WEIGHT, method=method, check_finite=False),
                                    halves, params, rows=[8, 8], on=(x,))
    assert value.isnan()
