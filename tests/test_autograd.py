"""Errors of the core API, and the lifetime of the graph of a gradient."""

import gc
import weakref

import pytest
import torch
from torch import nn

import gradreg
from gradreg import GradientError
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
