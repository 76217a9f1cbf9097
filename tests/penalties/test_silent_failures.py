"""Inputs on which the core API once gave a wrong answer that looked right: each now gives the
right value (checked against an independent computation) or a refusal naming the fix."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import gradreg
from gradreg import GradientError, NonFiniteError
from gradreg.penalties import (
    as_points,
    derivative,
    make_penalty,
    path_length,
    r1,
    spectral,
    wgan_gp,
)
from gradreg.penalties.guards.finite import FiniteCheck

F64 = torch.float64


# --- capture() of a submodule followed by an in-place op ----------------------------------------

class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock on vectors: ``ReLU(inplace=True)`` after the first layer
    and ``out += identity`` before the last ReLU; ``in_place=False`` is the same network written
    without in-place ops (the oracle)."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.relu = nn.ReLU(inplace=in_place)

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.l1(x))
        out = self.l2(out)
        if self.in_place:
            out += identity
        else:
            out = out + identity
        return self.relu(out)


def twins(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    in_place = cls(in_place=True).double()
    oracle = cls(in_place=False).double()
    oracle.load_state_dict(in_place.state_dict())
    return in_place, oracle


def captured_gradient(net: nn.Module, x: Tensor, layer: str) -> tuple[Tensor, Tensor]:
    with gradreg.capture(net, layer) as acts:
        y = net(x).square().sum()
    return acts[layer], gradreg.gradient(y, acts[layer])


def test_capture_before_in_place_relu_and_residual_add_is_the_layer_output_gradient() -> None:
    """dy/dl1 of the in-place block equals the out-of-place twin's; in particular it is 0 on
    the units the in-place ReLU zeroes (the post-ReLU tensor's gradient is not)."""
    net, oracle = twins(BasicBlock)
    x = torch.randn(6, 4, dtype=F64)
    h, g = captured_gradient(net, x, "l1")
    h_ref, g_ref = captured_gradient(oracle, x, "l1")
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)  # the layer's output, not post-ReLU
    torch.testing.assert_close(g, g_ref, rtol=1e-14, atol=1e-15)
    assert (h < 0).any() and bool((g[h < 0] == 0).all())
    assert not bool((g[h > 0] == 0).all())


def test_intermediate_penalty_on_an_in_place_block_equals_the_out_of_place_twin() -> None:
    net, oracle = twins(BasicBlock)
    x = torch.randn(6, 4, dtype=F64)
    values, grads = [], []
    for model in (net, oracle):
        penalty = make_penalty("intermediate", layers=["l1"])
        with gradreg.capture(model, "l1") as acts:
            per_sample = model(x).square().sum(1)
        value = penalty(per_sample, [acts["l1"]])
        values.append(value)
        grads.append(torch.autograd.grad(value, list(model.parameters())))
    torch.testing.assert_close(values[0], values[1], rtol=1e-14, atol=0)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


class LaterInPlace(nn.Module):
    """A layer, then one in-place op on its output in a later step of the forward."""

    def __init__(self, in_place: bool, op: str = "add_") -> None:
        super().__init__()
        self.in_place, self.op = in_place, op
        self.l1, self.l2 = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        if self.op == "add_":
            h = h.add_(1.0) if self.in_place else h + 1.0
        elif self.op == "relu_":
            h = torch.relu_(h) if self.in_place else torch.relu(h)
        elif self.in_place:  # "view": += on a slice of the output
            h[:, :2] += h[:, 2:].exp()
        else:
            h = torch.cat([h[:, :2] + h[:, 2:].exp(), h[:, 2:]], 1)
        return self.l2(h.tanh())


@pytest.mark.parametrize("op", ["add_", "relu_", "view"])
def test_capture_before_other_in_place_ops_matches_the_out_of_place_twin(op: str) -> None:
    torch.manual_seed(0)
    net = LaterInPlace(True, op).double()
    oracle = LaterInPlace(False, op).double()
    oracle.load_state_dict(net.state_dict())
    x = torch.randn(5, 3, dtype=F64)
    h, g = captured_gradient(net, x, "l1")
    h_ref, g_ref = captured_gradient(oracle, x, "l1")
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=1e-14, atol=1e-15)


Pair = namedtuple("Pair", "a b")


class TwoOutputs(nn.Module):
    """A submodule with two outputs: a tuple, a namedtuple or a dict."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.l1 = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> object:
        a, b = self.l1(x), 2 * x
        return {"tuple": (a, b), "namedtuple": Pair(a, b), "dict": {"a": a, "b": b}}[self.kind]


class TwoOutputsNet(nn.Module):
    """The first output of :class:`TwoOutputs` through a ReLU, in place unless ``in_place`` is
    False (the oracle)."""

    def __init__(self, in_place: bool, kind: str = "tuple") -> None:
        super().__init__()
        self.in_place, self.kind = in_place, kind
        self.two = TwoOutputs(kind)

    def forward(self, x: Tensor) -> Tensor:
        out = self.two(x)
        a, b = (out["a"], out["b"]) if self.kind == "dict" else out
        a = a.relu_() if self.in_place else a.relu()
        return (a * b).sum(1)


@pytest.mark.parametrize("kind", ["tuple", "namedtuple", "dict"])
def test_capture_of_a_tuple_output_before_in_place_ops(kind: str) -> None:
    torch.manual_seed(0)
    net = TwoOutputsNet(True, kind).double()
    oracle = TwoOutputsNet(False, kind).double()
    oracle.load_state_dict(net.state_dict())
    x = torch.randn(5, 3, dtype=F64)
    grads = []
    for model in (net, oracle):
        with gradreg.capture(model, "two") as acts:
            y = model(x).sum()
        out = acts["two"]
        first = out["a"] if kind == "dict" else out[0]
        grads.append(gradreg.gradient(y, first))
        assert type(out) is type(net.two(x))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert bool((grads[0] == 0).any())  # the units the ReLU zeroes


class ViewOfModified(nn.Module):
    """``Flatten``'s output is a view of the layer's output, which a later ReLU modifies in
    place: the captured view changes with it."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.flat, self.l2 = nn.Linear(3, 4), nn.Flatten(), nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        flat = self.flat(h)
        h.relu_()
        return self.l2(flat)


def test_capture_of_a_view_whose_base_is_modified_in_place_is_refused() -> None:
    net = ViewOfModified().double()
    with gradreg.capture(net, "flat") as acts:
        y = net(torch.randn(2, 3, dtype=F64)).sum()
    with pytest.raises(GradientError, match="do not depend on input 0"):
        gradreg.gradient(y, acts["flat"])


def test_captured_gradient_matches_finite_differences() -> None:
    """dy/dh at h = l1(x) by central differences of y(h) = rest of the in-place block."""
    net, _ = twins(BasicBlock)
    x = torch.randn(2, 4, dtype=F64)
    h, g = captured_gradient(net, x, "l1")

    def rest(h: Tensor) -> Tensor:
        out = net.l2(torch.relu(h)) + x
        return torch.relu(out).square().sum()

    eps = 1e-6
    fd = torch.zeros_like(h)
    for idx in np.ndindex(*h.shape):
        step = torch.zeros_like(h)
        step[idx] = eps
        fd[idx] = (rest(h.detach() + step) - rest(h.detach() - step)) / (2 * eps)
    torch.testing.assert_close(g, fd, rtol=1e-6, atol=1e-8)


# --- every=k needs due() -----------------------------------------------------------------------

def linear_critic() -> nn.Module:
    critic = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        critic.weight.copy_(torch.tensor([[1.0, 2.0]]))
    return critic


def test_a_lazy_penalty_called_without_due_is_refused() -> None:
    """Called on every step, r1(10, every=16) would be 16 times too large: refused."""
    critic, penalty = linear_critic(), r1(10.0, every=16)
    x = as_points(torch.randn(3, 2, dtype=F64))
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
    x = as_points(torch.randn(3, 2, dtype=F64))
    total = sum(lazy(critic(x).squeeze(1), x).item() for _ in range(16) if lazy.due())
    assert total == pytest.approx(16 * r1(10.0)(critic(x).squeeze(1), x).item(), rel=1e-14)
    assert lazy.steps_taken == 16


def test_every_one_needs_no_due() -> None:
    critic, x = linear_critic(), as_points(torch.randn(3, 2, dtype=F64))
    assert r1(10.0)(critic(x).squeeze(1), x).item() == pytest.approx(25.0, rel=1e-14)


# --- path length: the running mean only takes finite batches ------------------------------------

def generator() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()


def pl_call(penalty: nn.Module, g: nn.Module, w: Tensor, seed: int) -> Tensor:
    torch.manual_seed(seed)  # the same projection noise for both penalties
    w = as_points(w)
    return penalty(g(w), w)


@pytest.mark.parametrize("check_finite", [True, False])
def test_a_nan_batch_leaves_the_path_length_mean_as_it_was(check_finite: bool) -> None:
    """A NaN batch between clean ones: the running mean and the later values are those of a
    penalty that never saw it (bitwise), and the checkpointed mean is finite."""
    g = generator()
    clean = [torch.randn(4, 3, dtype=F64) for _ in range(3)]
    bad = clean[0].clone()
    bad[1, 0] = float("nan")
    penalty = path_length(check_finite=check_finite)
    oracle = path_length()
    pl_call(penalty, g, clean[0], 0)
    pl_call(oracle, g, clean[0], 0)
    before = penalty.ema.clone()
    if check_finite:
        with pytest.raises(NonFiniteError, match="points of call 2"):
            pl_call(penalty, g, bad, 1)
    else:
        assert torch.isnan(pl_call(penalty, g, bad, 1))
    assert torch.equal(penalty.ema, before)
    for seed, w in enumerate(clean[1:], start=2):
        value, expected = pl_call(penalty, g, w, seed), pl_call(oracle, g, w, seed)
        assert torch.isfinite(value) and torch.equal(value, expected)
    assert torch.equal(penalty.ema, oracle.ema) and penalty.ema.item() != 0.0
    assert torch.isfinite(penalty.state_dict()["ema"])


# --- regularized_backward never touches parameters it was not given ----------------------------

def test_regularized_backward_with_all_parameters_frozen_is_refused() -> None:
    frozen = torch.tensor(2.0, dtype=F64)  # requires_grad=False
    other = torch.tensor(3.0, dtype=F64, requires_grad=True)  # in the graph, not given
    loss = frozen * other
    with pytest.raises(GradientError, match=r"all 1 parameters given are frozen"):
        gradreg.regularized_backward(loss, [], [frozen])
    with pytest.raises(GradientError, match="no parameters were given"):
        gradreg.regularized_backward(loss, [], [])
    assert other.grad is None and frozen.grad is None
    given = torch.tensor(5.0, dtype=F64, requires_grad=True)
    gradreg.regularized_backward(loss * given, [], [frozen, given])
    assert given.grad.item() == 6.0 and other.grad is None  # d(2 * 3 * given)/d given


# --- points of one scalar per sample -------------------------------------------------------------

def test_derivative_of_a_one_dimensional_function_takes_b_points() -> None:
    """u(x) = x^3 at x = [1, 2]: u'' = 6x, the penalty mean (6x)^2 = (36 + 144) / 2 = 90."""
    x = as_points(torch.tensor([1.0, 2.0], dtype=F64))
    assert derivative(1.0)(x.pow(3), x).item() == pytest.approx(90.0, rel=1e-14)
    # R1 of D(x) = 3x per sample: 10/2 * 9 = 45
    assert r1()(3 * x, x).item() == pytest.approx(45.0, rel=1e-14)
    one = torch.tensor(2.0, dtype=F64, requires_grad=True)  # a 0-d point: one sample
    assert r1()(3 * one, one).item() == pytest.approx(45.0, rel=1e-14)


def test_spectral_norm_of_a_b_output_and_of_b_points() -> None:
    """f(x) = w.x (output [B]): sigma = |w| = 5, penalty 25; f(x) = 2x on [B] points: 4."""
    w = torch.tensor([3.0, 4.0], dtype=F64)
    x = as_points(torch.randn(3, 2, dtype=F64))
    assert spectral(1.0, iterations=2)(lambda q: q @ w, x).item() == pytest.approx(25.0, rel=1e-12)
    s = as_points(torch.randn(3, dtype=F64))
    assert spectral(1.0, iterations=2)(lambda q: 2 * q, s).item() == pytest.approx(4.0, rel=1e-12)


# --- points the penalty would silently combine wrongly -----------------------------------------

def test_points_of_different_batch_sizes_are_refused() -> None:
    a, c = as_points(torch.randn(8, 4)), as_points(torch.randn(1, 4))
    with pytest.raises(GradientError, match=r"batch sizes \[8, 1\]"):
        r1()((a + c).sum(1), [a, c])


def test_the_same_tensor_twice_is_refused() -> None:
    a = as_points(torch.randn(4, 2))
    with pytest.raises(GradientError, match="points 0 and 1 are the same tensor"):
        r1()(a.sum(1), [a, a])
    with pytest.raises(GradientError, match="same tensor"):
        make_penalty("param_grad_norm")(a.sum(), [a, a])


def test_complex_points_and_outputs_are_refused() -> None:
    z = torch.randn(3, 2, dtype=torch.complex128).requires_grad_()
    with pytest.raises(GradientError, match=r"point 0 is complex .*view_as_real"):
        r1()(z.abs().sum(1), z)
    x = as_points(torch.randn(3, 2, dtype=F64))
    with pytest.raises(GradientError, match="the outputs are complex"):
        r1()(x.sum(1) * (1 + 1j), x)


def test_finite_float64_values_beyond_float32_range_are_not_reported() -> None:
    """Points of 1e300, D(x) = 1e-3 * sum(x): ||g||^2 = 2e-6, R1 = 5 * 2e-6 = 1e-5."""
    x = as_points(torch.full((2, 2), 1e300, dtype=F64))
    assert r1()(1e-3 * x.sum(1), x).item() == pytest.approx(1e-5, rel=1e-12)
    check = FiniteCheck()
    check(torch.tensor(1e300, dtype=F64), points=(x,))  # a finite float64 penalty of 1e300
    with pytest.raises(NonFiniteError, match="points of call 2"):
        check(torch.tensor(1.0, dtype=F64), points=(torch.tensor([1e300, float("inf")]),))
    with pytest.raises(NonFiniteError, match="penalty of call 3 is inf"):
        check(torch.tensor(float("inf"), dtype=F64))


@pytest.mark.parametrize("one_sided", [False, True])
@pytest.mark.parametrize("power", [0.5, 0.25])
def test_power_below_one_at_the_target_has_a_zero_subgradient(power: float,
                                                              one_sided: bool) -> None:
    """D(x) = w (0.6, 0.8).x with w = 1: ||g|| = 1 = the target, the penalty 0 and its
    gradient w.r.t. w the subgradient 0 (torch's own is 0 * inf = NaN)."""
    w = torch.tensor(1.0, dtype=F64, requires_grad=True)
    x = as_points(torch.randn(3, 2, dtype=F64))
    outputs = w * (x @ torch.tensor([0.6, 0.8], dtype=F64))
    value = wgan_gp(power=power, one_sided=one_sided)(outputs, x)
    (grad,) = torch.autograd.grad(value, w)
    assert value.item() == pytest.approx(0.0, abs=1e-14) and grad.item() == 0.0
    # away from the kink, w = 2: 10 * |2 - 1|^power = 10, d/dw = 10 * power
    w2 = torch.tensor(2.0, dtype=F64, requires_grad=True)
    value = wgan_gp(power=power, one_sided=one_sided)(
        w2 * (x @ torch.tensor([0.6, 0.8], dtype=F64)), x)
    (grad,) = torch.autograd.grad(value, w2)
    assert value.item() == pytest.approx(10.0, rel=1e-14)
    assert grad.item() == pytest.approx(10.0 * power, rel=1e-12)


# --- weights and numeric options ----------------------------------------------------------------

@pytest.mark.parametrize(("weight", "expected"), [
    (np.float32(2.5), 2.5), (np.float64(0.5), 0.5), (np.int64(3), 3.0), (np.array(1.5), 1.5),
    (torch.tensor(4.0), 4.0), (torch.tensor(2, dtype=torch.int32), 2.0), (7, 7.0)])
def test_numpy_scalars_and_0d_tensors_are_weights(weight: object, expected: float) -> None:
    penalty = r1(weight)
    assert penalty.weight == expected and type(penalty.weight) is float


@pytest.mark.parametrize(("weight", "message"), [
    (10**400, r"weight is an integer of 1329 bits, too large for a float"),
    (True, "weight must be a number, got bool True"),
    ("1.0", "weight must be a number, got str '1.0'"),
    (torch.tensor([1.0, 2.0]), r"weight must be a number, got a tensor of shape \(2,\)"),
    (float("inf"), "weight must be a finite number >= 0, got inf"),
    (np.float64("nan"), "weight must be a finite number >= 0"),
    (np.bool_(True), "weight must be a number, got bool True"),
    (np.ones(2), "weight must be a number, got ndarray"),
], ids=["huge_int", "bool", "str", "vector", "inf", "nan", "numpy_bool", "numpy_vector"])
def test_weights_that_are_not_finite_numbers_are_refused(weight: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        r1(weight)


@pytest.mark.parametrize(("options", "message"), [
    ({"gain": 10**400}, "gain is an integer of"),
    ({"target": True}, "target must be a number, got bool"),
    ({"power": "2"}, "power must be a number, got str"),
    ({"one_sided": "yes"}, "one_sided is a flag: pass True or False"),
    ({"gain": float("inf")}, "gain must be a finite number"),
])
def test_numeric_options_that_are_not_numbers_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        r1(**options)


def test_numpy_options_are_converted_to_floats() -> None:
    penalty = wgan_gp(target=np.float32(0.5), p=float("inf"))
    config = penalty.config
    assert config.target == 0.5 and type(config.target) is float and config.p == float("inf")


# --- the rest of an adversarial pass: what already held ---------------------------------------

def test_empty_batches_and_points_without_grad_are_refused() -> None:
    x = as_points(torch.randn(0, 2))
    with pytest.raises(GradientError, match="empty batch"):
        r1()(x.sum(1), x)
    y = torch.randn(3, 2)
    with pytest.raises(GradientError, match="does not require grad"):
        r1()(y.sum(1), y)


def test_channels_last_and_non_contiguous_points_give_the_contiguous_value() -> None:
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.LazyLinear(1)).double()
    x = torch.randn(4, 2, 5, 5, dtype=F64)
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
