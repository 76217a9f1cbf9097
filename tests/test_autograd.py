"""Errors of the core API, and the lifetime of the graph of a gradient."""

import gc
import weakref
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import gradreg
from gradreg import GradientError
from gradreg.penalties import (
    make_penalty,
)
from tests.once_differentiable import OnceSquare


def test_non_scalar_output_needs_grad_outputs_and_says_so() -> None:
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(GradientError, match="only for scalar outputs.*grad_outputs=torch.ones"):
        gradreg.gradient(x + 2, x)
    g = gradreg.gradient(x + 2, x, grad_outputs=torch.ones(2))
    assert torch.equal(g, torch.ones(2))


def test_input_without_requires_grad() -> None:
    x = torch.ones(2)
    with pytest.raises(GradientError, match=r"input 0 .*does not require grad.*requires_grad_\(\)"):
        gradreg.gradient((x * 2).sum(), x)


def test_output_not_depending_on_an_input_names_it() -> None:
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    with pytest.raises(GradientError, match=r"do not depend on input 1 \(shape \(3,\)\)"):
        gradreg.gradient((a * 2).sum(), [a, b])


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_and_bool_inputs(dtype: torch.dtype) -> None:
    with pytest.raises(GradientError, match=f"dtype {dtype}.*float"):
        gradreg.gradient(torch.ones(()), torch.ones(2, dtype=dtype))


def test_no_grad_and_inference_mode() -> None:
    x = torch.ones(2, requires_grad=True)
    y = (x * x).sum()
    with torch.no_grad(), pytest.raises(GradientError, match=r"no_grad\(\).*enable_grad"):
        gradreg.gradient(y, x)
    with torch.inference_mode(), pytest.raises(GradientError, match="inference_mode"):
        gradreg.gradient(y, x)
    with torch.no_grad():
        y_no_graph = (x * x).sum()
    with pytest.raises(GradientError, match="does not require grad.*no_grad"):
        gradreg.gradient(y_no_graph, x)


def test_freed_graph_wraps_torch_message() -> None:
    x = torch.ones(1, requires_grad=True)
    y = x**7
    gradreg.gradient(y, x, create_graph=False)
    with pytest.raises(GradientError, match="retain_graph=True.*Torch said: Trying to") as info:
        gradreg.gradient(y, x)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_create_graph_retains_forward_graph_by_default() -> None:
    x = torch.ones(1, requires_grad=True)
    y = x**7
    assert gradreg.gradient(y, x).item() == 7.0
    assert gradreg.gradient(y, x).item() == 7.0


def test_capture_unknown_name_lists_valid_names_and_hooks_removed_on_error() -> None:
    net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    with (
        pytest.raises(ValueError, match=r"unknown submodule name\(s\) \['body'\].*'0', '1', '2'"),
        gradreg.capture(net, "body"),
    ):
        pass
    with pytest.raises(KeyError), gradreg.capture(net, "1"):
        raise KeyError("inside")
    assert all(not m._forward_hooks for m in net.modules())


def test_capture_records_latest_output_and_per_sample_gradients() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(4, 2)
    with gradreg.capture(net, "1") as acts:
        out = net(x)
    h = acts["1"]
    assert torch.equal(h, torch.tanh(net[0](x)))
    g = gradreg.gradient(out, h, grad_outputs=torch.ones_like(out))
    assert torch.allclose(g, net[2].weight.expand(4, 3))


def test_graph_of_gradient_is_freed_after_backward() -> None:
    """No tensor of step k is alive at step k+1: weak references to the step's tensors die."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    refs = []
    for _ in range(3):
        x = torch.randn(5, 3).requires_grad_()
        out = net(x)
        g = gradreg.gradient(out, x, grad_outputs=torch.ones_like(out))
        penalty = g.pow(2).sum(1).mean()
        gradreg.regularized_backward(out.mean(), [penalty], net.parameters())
        opt.step()
        refs.append([weakref.ref(t) for t in (x, out, g, penalty)])
        del x, out, g, penalty
        gc.collect()
        assert all(r() is None for r in refs[-1])
    assert all(p.grad is not None and p.grad.grad_fn is None for p in net.parameters())


def test_check_double_backward_names_the_op() -> None:
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    g = gradreg.gradient((OnceSquare.apply(x) * w).sum(), x)
    with pytest.raises(GradientError, match="once_differentiable.*finite_difference"):
        gradreg.check_double_backward(g)
    gradreg.check_double_backward(gradreg.gradient((x.tanh() * w).sum(), x))  # passes


def test_check_double_backward_on_op_without_formula() -> None:
    torch.manual_seed(0)
    lp = torch.randn(6, 2, 4).log_softmax(2).detach().requires_grad_()
    w = torch.randn(4, 4, requires_grad=True)
    loss = nn.functional.ctc_loss((lp @ w).log_softmax(2), torch.randint(1, 4, (2, 3)),
                                  torch.full((2,), 6), torch.full((2,), 3))
    with pytest.raises(GradientError, match="_ctc_loss_backward is not implemented"):
        gradreg.check_double_backward(gradreg.gradient(loss, lp))


def test_graph_leaves_finds_each_leaf_once_through_the_graph_of_a_gradient() -> None:
    w = torch.tensor([2.0, 3.0], requires_grad=True)
    b = torch.tensor(1.0, requires_grad=True)
    x = torch.tensor([1.0, -1.0], requires_grad=True)
    y = ((w * x).sum() + b) ** 2
    (g,) = torch.autograd.grad(y, x, create_graph=True)  # 2 (w.x + b) w: depends on w, b, x
    found = gradreg.graph.graph_leaves([g.square().sum(), y])
    assert sorted(id(t) for t in found) == sorted(id(t) for t in (w, b, x))
    assert gradreg.graph.graph_leaves([torch.ones(2)]) == []  # no graph, no leaves


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


def twins(cls: type[nn.Module], **options: object) -> tuple[nn.Module, nn.Module]:
    """The module ``cls`` with its in-place ops, and its out-of-place twin (the oracle) with the
    same seeded weights, in float64."""
    torch.manual_seed(0)
    in_place = cls(in_place=True, **options).double()
    oracle = cls(in_place=False, **options).double()
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
    x = torch.randn(6, 4, dtype=torch.float64)
    h, g = captured_gradient(net, x, "l1")
    h_ref, g_ref = captured_gradient(oracle, x, "l1")
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)  # the layer's output, not post-ReLU
    torch.testing.assert_close(g, g_ref, rtol=1e-14, atol=1e-15)
    assert (h < 0).any() and bool((g[h < 0] == 0).all())
    assert not bool((g[h > 0] == 0).all())


def test_intermediate_penalty_on_an_in_place_block_equals_the_out_of_place_twin() -> None:
    net, oracle = twins(BasicBlock)
    x = torch.randn(6, 4, dtype=torch.float64)
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
    net, oracle = twins(LaterInPlace, op=op)
    x = torch.randn(5, 3, dtype=torch.float64)
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
    net, oracle = twins(TwoOutputsNet, kind=kind)
    x = torch.randn(5, 3, dtype=torch.float64)
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
        y = net(torch.randn(2, 3, dtype=torch.float64)).sum()
    with pytest.raises(GradientError, match="do not depend on input 0"):
        gradreg.gradient(y, acts["flat"])


def test_captured_gradient_matches_finite_differences() -> None:
    """dy/dh at h = l1(x) by central differences of y(h) = rest of the in-place block."""
    net, _ = twins(BasicBlock)
    x = torch.randn(2, 4, dtype=torch.float64)
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
