"""Mechanism properties: estimator bias, batch-split invariance, laziness, stability, errors."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradreg
from gradreg import GradientError
from gradreg.penalties import (
    PRESETS,
    GradientPenalty,
    as_points,
    gradient_penalty,
    interpolate,
    jacobian,
    make_penalty,
    r1,
    wgan_gp,
)
from tests.once_differentiable import OnceSquare

from .conftest import mlp


def exact_frobenius_sq(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mean over samples of ||J_i||_F^2, the Jacobian from torch.autograd.functional."""
    jac = torch.stack([torch.autograd.functional.jacobian(model, xi) for xi in x])
    return jac.pow(2).sum((1, 2)).mean()


def test_jacobian_estimate_exact_at_full_rank_and_unbiased() -> None:
    torch.manual_seed(0)
    model = mlp(3, 4)
    x = torch.randn(6, 3, dtype=torch.float64)
    exact = exact_frobenius_sq(model, x)
    points = as_points(x)
    full = jacobian(1.0, count=4)(model(points), points)
    assert full.item() == pytest.approx(exact.item(), rel=1e-12)
    one = jacobian(1.0, count=1)
    draws = []
    for _ in range(200):
        points = as_points(x)
        draws.append(one(model(points), points).item())
    draws = torch.tensor(draws, dtype=torch.float64)
    standard_error = draws.std() / len(draws) ** 0.5
    assert draws.std() > 0  # a real estimator, not the exact value
    assert abs(draws.mean() - exact) < 4 * standard_error


@pytest.mark.parametrize("preset", ["r1", "double_backprop", "jacobian_full"])
def test_micro_batches_average_to_full_batch(preset: str) -> None:
    """Per-sample norms of the gradient of the *sum*: two halves averaged = the whole batch."""
    torch.manual_seed(0)
    model = mlp(3, 4)
    x = torch.randn(8, 3, dtype=torch.float64)
    labels = torch.randint(0, 4, (8,))

    def value_and_grads(rows: slice) -> tuple[torch.Tensor, list[torch.Tensor]]:
        points = as_points(x[rows])
        logits = model(points)
        if preset == "r1":
            penalty = r1()(logits[:, 0], points)
        elif preset == "double_backprop":
            losses = F.cross_entropy(logits, labels[rows], reduction="none")
            penalty = make_penalty("double_backprop")(losses, points)
        else:
            penalty = jacobian(count=4)(logits, points)
        grads = torch.autograd.grad(penalty, list(model.parameters()), materialize_grads=True)
        return penalty.detach(), list(grads)

    full_value, full_grads = value_and_grads(slice(0, 8))
    (v1, g1), (v2, g2) = value_and_grads(slice(0, 4)), value_and_grads(slice(4, 8))
    assert ((v1 + v2) / 2).item() == pytest.approx(full_value.item(), rel=1e-12)
    for full, a, b in zip(full_grads, g1, g2, strict=True):
        torch.testing.assert_close((a + b) / 2, full, rtol=1e-12, atol=1e-14)


def _double_backward_nodes(tensor: torch.Tensor) -> list[str]:
    return [n for n in gradreg.autograd_graph(tensor).names() if "BackwardBackward" in n]


def test_lazy_every_k_scales_by_k_and_builds_nothing_off_step() -> None:
    torch.manual_seed(0)
    critic = mlp(3, 1)
    x = torch.randn(5, 3, dtype=torch.float64)
    eager, lazy = r1(), r1(every=3)
    points = as_points(x)
    one_step = torch.autograd.grad(eager(critic(points), points), list(critic.parameters()),
                                   materialize_grads=True)
    summed = [torch.zeros_like(p) for p in critic.parameters()]
    pattern = []
    for _ in range(3):
        points = as_points(x)
        loss = critic(points).mean()
        due = lazy.due()
        pattern.append(due)
        if due:
            loss = loss + lazy(critic(points), points)
            assert _double_backward_nodes(loss)
        else:
            assert _double_backward_nodes(loss) == []
        grads = torch.autograd.grad(loss, list(critic.parameters()))
        task = torch.autograd.grad(critic(as_points(x)).mean(), list(critic.parameters()))
        for acc, g, t in zip(summed, grads, task, strict=True):
            acc += g - t
    assert pattern == [True, False, False]
    assert lazy.lazy_step.item() == lazy.steps_taken == 3
    for acc, g in zip(summed, one_step, strict=True):
        torch.testing.assert_close(acc, 3 * g, rtol=1e-12, atol=1e-14)


def test_factor_is_weight_times_every_times_gain_and_weights_the_value() -> None:
    """``factor`` = weight * every * gain (R1's gain 1/2), the weighted value ``factor *
    last_value``; a weight set later changes it."""
    torch.manual_seed(0)
    critic = mlp(3, 1)
    penalty = r1(10.0, every=4)
    assert penalty.factor == 10.0 * 4 * 0.5
    penalty.weight = 2.0
    assert penalty.factor == 2.0 * 4 * 0.5
    points = as_points(torch.randn(5, 3, dtype=torch.float64))
    assert penalty.due()
    value = penalty(critic(points), points)
    torch.testing.assert_close(value.detach(), penalty.factor * penalty.last_value,
                               rtol=0, atol=0)


def test_constant_critic_gives_zero_penalty_and_finite_gradient() -> None:
    weight = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    x = as_points(torch.randn(4, 3, dtype=torch.float64))
    outputs = weight * (0 * x).sum(1) + weight  # D constant in x: zero input gradient
    value = r1()(outputs, x)
    (g,) = torch.autograd.grad(value, weight, retain_graph=True)
    assert value.item() == 0.0 and g.item() == 0.0
    one_sided_at_target = wgan_gp()(outputs, x)  # norm 0, target 1: penalty 10 * 1
    (g,) = torch.autograd.grad(one_sided_at_target, weight, retain_graph=True)
    assert one_sided_at_target.item() == 10.0 and torch.isfinite(g)
    for p in (1.0, 3.0):
        value = GradientPenalty(p=p, power=1.0)(outputs, x)
        (g,) = torch.autograd.grad(value, weight, retain_graph=True)
        assert value.item() == 0.0 and torch.isfinite(g)


def test_p_norm_sidedness_power_and_reduction() -> None:
    x = as_points(torch.tensor([[3.0, -4.0], [0.5, 0.0]], dtype=torch.float64))
    outputs = (x * torch.tensor([1.0, 1.0], dtype=torch.float64)).sum(1) * x[:, 0]
    # per-sample gradients: [2*x0 + x1, x0] -> [2, 3] and [1, 0.5]
    g = torch.tensor([[2.0, 3.0], [1.0, 0.5]], dtype=torch.float64)
    l1 = g.abs().sum(1)  # 5, 1.5
    value = gradient_penalty(outputs, x, p=1, target=2.0, power=3, reduction="sum")
    assert value.item() == pytest.approx(((l1 - 2).abs() ** 3).sum().item())
    one_sided = gradient_penalty(outputs, x, p=1, target=2.0, one_sided=True, reduction="none")
    assert one_sided.tolist() == pytest.approx([9.0, 0.0])
    assert gradient_penalty(outputs, x).item() == pytest.approx(g.pow(2).sum(1).mean().item())


def test_intermediate_power_one_reproduces_seed_minimize_f() -> None:
    """Seed 001: penalizing f = dy/dl (= 120) on the activation l gives grads 32, 108, 4."""
    net = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1))
    with torch.no_grad():
        net[0].weight.fill_(3.0)
        net[1].weight.fill_(2.0)
        net[1].bias.fill_(6.0)
    penalty = make_penalty("intermediate", weight=1.0, layers=["0"], power=1.0)
    with gradreg.capture(net, *penalty.config.layers) as acts:
        y = net(torch.tensor([[4.0]])).pow(2)
    value = penalty(y, list(acts.values()))
    assert value.item() == 120.0
    value.backward()
    assert [p.grad.item() for p in net.parameters()] == [32.0, 108.0, 4.0]


def test_state_round_trips_through_state_dict() -> None:
    penalty = make_penalty("path_length", every=4)
    generator = mlp(2, 6)
    for _ in range(5):
        if penalty.due():
            w = torch.randn(3, 2, dtype=torch.float64).requires_grad_()
            penalty(generator(w), w)
    penalty.weight = 0.5
    restored = make_penalty("path_length", every=4)
    restored.load_state_dict(penalty.state_dict())
    assert restored.lazy_step.item() == restored.steps_taken == 5 and restored.weight == 0.5
    assert restored.ema.item() == penalty.ema.item() != 0.0
    # the lazy phase goes on where it stopped: steps 5, 6, 7 off, 8 due
    assert [restored.due() for _ in range(4)] == [False, False, False, True]
    assert [penalty.due() for _ in range(4)] == [False, False, False, True]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: make_penalty("wgan"), "unknown penalty preset 'wgan'; known presets: wgan_gp"),
        (lambda: make_penalty("r1", gamma=1), r"unknown option\(s\) \['gamma'\].*weight"),
        (lambda: r1(weight=-1.0), "weight must be a finite number >= 0, got -1.0"),
        (lambda: r1(weight=float("nan")), "weight must be a finite number"),
        (lambda: r1(every=0), "every must be an int >= 1"),
        (lambda: wgan_gp(target=-1.0), "target must be a number >= 0"),
        (lambda: r1(p=0), "p .* must be > 0"),
        (lambda: r1(reduction="median"), "reduction must be one of"),
        (lambda: make_penalty("intermediate"), "needs layers="),
        (lambda: interpolate(torch.zeros(4, 2), torch.zeros(3, 2)), "same shape, got"),
    ],
)
def test_bad_configuration_errors(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_weight_set_later_is_validated() -> None:
    penalty = r1()
    with pytest.raises(ValueError, match=">= 0"):
        penalty.weight = -0.1


def test_outputs_not_depending_on_points_and_missing_double_backward() -> None:
    x = as_points(torch.randn(4, 3))
    other = as_points(torch.randn(4, 3))
    with pytest.raises(GradientError, match="do not depend on input 0"):
        r1()(other.sum(1), x)

    class OnceTanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):
            ctx.save_for_backward(v)
            return v.tanh()

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_out):
            (v,) = ctx.saved_tensors
            return grad_out * (1 - v.tanh() ** 2)

    layer = nn.Linear(3, 1)
    with pytest.raises(GradientError, match="once_differentiable.*method='finite_difference'"):
        r1()(layer(OnceTanh.apply(x * 2)).squeeze(1), x)


def test_a_once_differentiable_op_at_the_output_is_refused_not_silently_dropped() -> None:
    """D(x) = (w·x)²: ∇_x D = 2(w·x)w, R1 = mean ‖∇_x D‖² = 4 mean (w·x)² ‖w‖², whose gradient
    w.r.t. w needs the op's second derivative. At the output the op's incoming gradient is a
    constant, so torch leaves no error node: its backward returns 2(w·x) as a constant and the
    double backward would give 4 mean (w·x)² · 2w instead of the exact value, silently."""
    torch.manual_seed(0)
    x = as_points(torch.randn(5, 3))
    layer = nn.Linear(3, 1, bias=False)
    outputs = OnceSquare.apply(layer(x)).squeeze(1)
    g = gradreg.gradient(outputs.sum(), x)
    (dropped,) = torch.autograd.grad(g.square().sum(1).mean(), layer.weight)
    w, s = layer.weight.detach(), (x.detach() @ layer.weight.detach().T).squeeze(1)
    exact = 8 * ((s * s).mean() * w + (s[:, None] * x.detach()).mean(0) * w.square().sum())
    assert not torch.allclose(dropped, exact, rtol=1e-3)  # what passing it through would give
    with pytest.raises(GradientError, match="OnceSquare is an autograd.Function whose backward is "
                       "marked @once_differentiable.*method='perturbation'"):
        r1()(OnceSquare.apply(layer(x)).squeeze(1), x)


def test_non_finite_and_empty_batch_errors() -> None:
    x = torch.randn(3, 2)
    x[1, 0] = float("inf")
    x = as_points(x)
    with pytest.raises(GradientError, match="points of call 1 contain NaN or Inf"):
        r1()((x * x).sum(1), x)
    empty = as_points(torch.zeros(0, 2))
    with pytest.raises(GradientError, match="empty batch"):
        r1()(empty.sum(1), empty)


def test_loss_scale_unscales_gradients() -> None:
    torch.manual_seed(0)
    critic = mlp(3, 1)
    x = as_points(torch.randn(4, 3, dtype=torch.float64))
    plain = r1()(critic(x), x)
    scaled = r1()(critic(x), x, loss_scale=2.0**16)
    assert scaled.item() == pytest.approx(plain.item(), rel=1e-12)
    g_plain = torch.autograd.grad(plain, list(critic.parameters()), materialize_grads=True)
    g_scaled = torch.autograd.grad(scaled, list(critic.parameters()), materialize_grads=True)
    for a, b in zip(g_plain, g_scaled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_nan_gradient_is_not_hidden_by_the_safe_root() -> None:
    """A NaN squared norm must stay NaN (the root's zero branch is for exact zeros only): finite
    points and outputs whose gradient is NaN (sqrt's derivative at -1 under a where)."""
    x = as_points(torch.tensor([[-1.0, 1.0], [1.0, 2.0]]))
    outputs = torch.where(x < 0, 0.0, x.sqrt()).sum(1)
    with pytest.raises(GradientError, match=r"penalty of call 1 is nan \(not finite\)"):
        wgan_gp()(outputs, x)
    empty = as_points(torch.zeros(0, 3))
    with pytest.raises(GradientError, match="empty batch"):
        gradient_penalty(empty.square().sum(1), empty)


def gradreg_calls(step: Callable[[], None]) -> list[tuple[str, str]]:
    """The Python calls of gradreg's own code (the functions whose code file lies under the
    ``gradreg`` package) while ``step`` runs, as (file relative to the package, function)."""
    root = Path(gradreg.__file__).parent
    calls: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        file = frame.f_code.co_filename
        if event == "call" and file.startswith(str(root)):
            calls.append((Path(file).relative_to(root).as_posix(), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def test_a_wgan_gp_call_reads_top_to_bottom() -> None:
    """One steady-state ``make_penalty("wgan_gp")(D(x_hat), x_hat)`` and its backward, after two
    calls that ran the first call's one-off checks: the gradreg-level Python calls (functions
    defined under ``gradreg/``, comprehensions and lambdas included; torch's own are not
    counted) are 24 in 6 files: the mechanism, the double backward
    method, the checks of the points and of the outputs (each once), the norm's formulas,
    autograd's gradient and the finite check."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0))
    real, fake = torch.randn(16, 2), torch.randn(16, 2) + 1
    gp = make_penalty("wgan_gp")

    def step(x_hat: Tensor) -> None:
        gp(critic(x_hat), x_hat).backward()

    step(interpolate(real, fake))
    step(interpolate(real, fake))
    x_hat = interpolate(real, fake)
    calls = gradreg_calls(lambda: step(x_hat))
    files = {file for file, _ in calls}
    assert len(calls) <= 24, calls
    assert files == {"penalties/mechanism.py", "penalties/methods/double_backward.py",
                     "penalties/guards/checks.py", "penalties/formulas/norms.py",
                     "autograd.py", "penalties/guards/finite.py"}
    names = [name for _, name in calls]
    assert names.count("check_points") == names.count("check_outputs") == 1


def linear_critic() -> nn.Module:
    critic = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        critic.weight.copy_(torch.tensor([[1.0, 2.0]]))
    return critic


def test_a_lazy_penalty_called_without_due_is_refused() -> None:
    """Called on every step, r1(10, every=16) would be 16 times too large: refused."""
    critic, penalty = linear_critic(), r1(10.0, every=16)
    x = as_points(torch.randn(3, 2, dtype=torch.float64))
    with pytest.raises(GradientError, match=r"every=16: .*penalty.due\(\) returned True"):
        penalty(critic(x).squeeze(1), x)
    assert penalty.due()  # step 0 is due
    value = penalty(critic(x).squeeze(1), x)
    # D(x) = x1 + 2 x2: ||g||^2 = 5, R1 = 10/2 * 5 = 25, times every = 16
    assert value.item() == pytest.approx(16 * 25.0, rel=1e-14)
    value = penalty(critic(x).squeeze(1), x)  # a second call on the due step (micro-batches)
    assert value.item() == pytest.approx(400.0, rel=1e-14)
    assert not penalty.due()  # step 1 is not
    with pytest.raises(GradientError, match="every=16"):
        penalty(critic(x).squeeze(1), x)


def test_the_plain_loop_with_due_gives_the_eager_penalty_on_average() -> None:
    """Over 16 steps, `if gp.due(): loss += gp(...)` adds once 16 * 25 = 400 = 16 eager steps."""
    critic, lazy = linear_critic(), r1(10.0, every=16)
    x = as_points(torch.randn(3, 2, dtype=torch.float64))
    total = sum(lazy(critic(x).squeeze(1), x).item() for _ in range(16) if lazy.due())
    assert total == pytest.approx(16 * r1(10.0)(critic(x).squeeze(1), x).item(), rel=1e-14)
    assert lazy.steps_taken == 16


def test_every_one_needs_no_due() -> None:
    critic, x = linear_critic(), as_points(torch.randn(3, 2, dtype=torch.float64))
    assert r1(10.0)(critic(x).squeeze(1), x).item() == pytest.approx(25.0, rel=1e-14)


@pytest.mark.parametrize("one_sided", [False, True])
@pytest.mark.parametrize("power", [0.5, 0.25])
def test_power_below_one_at_the_target_has_a_zero_subgradient(power: float,
                                                              one_sided: bool) -> None:
    """D(x) = w (0.6, 0.8).x with w = 1: ||g|| = 1 = the target, the penalty 0 and its
    gradient w.r.t. w the subgradient 0 (torch's own is 0 * inf = NaN)."""
    w = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    x = as_points(torch.randn(3, 2, dtype=torch.float64))
    outputs = w * (x @ torch.tensor([0.6, 0.8], dtype=torch.float64))
    value = wgan_gp(power=power, one_sided=one_sided)(outputs, x)
    (grad,) = torch.autograd.grad(value, w)
    assert value.item() == pytest.approx(0.0, abs=1e-14) and grad.item() == 0.0
    # away from the kink, w = 2: 10 * |2 - 1|^power = 10, d/dw = 10 * power
    w2 = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    value = wgan_gp(power=power, one_sided=one_sided)(
        w2 * (x @ torch.tensor([0.6, 0.8], dtype=torch.float64)), x)
    (grad,) = torch.autograd.grad(value, w2)
    assert value.item() == pytest.approx(10.0, rel=1e-14)
    assert grad.item() == pytest.approx(10.0 * power, rel=1e-12)


def test_channels_last_and_non_contiguous_points_give_the_contiguous_value() -> None:
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.LazyLinear(1)).double()
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    conv(x)
    values = []
    for layout in (x, x.to(memory_format=torch.channels_last), x.transpose(2, 3).contiguous()
                   .transpose(2, 3)):
        points = as_points(layout)
        assert torch.equal(points, x)
        values.append(r1()(conv(points).squeeze(1), points))
    torch.testing.assert_close(values[1], values[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(values[2], values[0], rtol=1e-12, atol=0)


def test_float16_points_on_the_cpu() -> None:
    """D(x) = x.(1, 2) in float16: ||g||^2 = 5 exactly, R1 = 25."""
    critic = nn.Linear(2, 1, bias=False).half()
    with torch.no_grad():
        critic.weight.copy_(torch.tensor([[1.0, 2.0]]))
    x = as_points(torch.randn(3, 2).half())
    value = r1()(critic(x).squeeze(1), x)
    assert value.dtype == torch.float16 and value.item() == 25.0


# A penalty's state dict as earlier releases wrote it (the keys ``step``, ``ema`` and
# ``_extra_state`` with the weight) loads into the penalties of this one, for every preset.

PRESET_OPTIONS = {"intermediate": {"layers": ["act1"]}}


def _old_format(step: int, ema: float, weight: float) -> dict:
    """Written out by hand, as the earlier releases saved it (not by this code)."""
    return {"step": torch.tensor(step), "ema": torch.tensor(ema),
            "_extra_state": {"weight": weight}}


@pytest.mark.parametrize("name", list(PRESETS))
def test_an_old_state_dict_loads_with_its_counter_running_mean_and_weight(name: str) -> None:
    penalty = make_penalty(name, every=4, **PRESET_OPTIONS.get(name, {}))
    result = penalty.load_state_dict(_old_format(step=6, ema=0.25, weight=3.5))
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert penalty.weight == 3.5 and penalty.steps_taken == 6
    assert penalty.ema.item() == 0.25
    # the lazy counter goes on from 6: due on the 9th call (index 8), not on the 7th
    assert [penalty.due() for _ in range(4)] == [False, False, True, False]


def test_a_float64_running_mean_is_restored_in_float64() -> None:
    penalty = make_penalty("path_length")
    state = _old_format(step=1, ema=0.1, weight=2.0)
    state["ema"] = torch.tensor(0.1, dtype=torch.float64)
    penalty.load_state_dict(state)
    assert penalty.ema.dtype == torch.float64 and penalty.ema.item() == 0.1
