"""gradreg's BatchNorm against float64 finite differences and against torch's BatchNorm: value,
gradients, the double backward of a gradient penalty, running statistics, checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import gradcheck, gradgradcheck

import gradreg
from gradreg.batchnorm import BatchNorm1d, BatchNorm2d, batch_norm, convert_batchnorm
from gradreg.torch_compat import TorchDispatchMode


def _inputs(shape: tuple[int, ...], affine: bool) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    params = (torch.randn(3, dtype=torch.float64, requires_grad=True),
              torch.randn(3, dtype=torch.float64, requires_grad=True))
    return (x, *params) if affine else (x,)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(5, 3), (4, 3, 2, 3), (2, 3, 2, 2, 2)])
def test_gradcheck_and_gradgradcheck(shape: tuple[int, ...], affine: bool, training: bool) -> None:
    running = (torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5)

    def f(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return batch_norm(x, *running, *(params or (None, None)), training=training, eps=1e-3)

    args = _inputs(shape, affine)
    assert gradcheck(f, args)
    assert gradgradcheck(f, args)


def test_third_derivative_is_exact() -> None:
    """With create_graph in the double backward too, the statistics are recomputed in the graph."""
    args = _inputs((4, 3, 2, 2), affine=True)

    def input_gradient(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = batch_norm(x, None, None, w, b, training=True)
        return torch.autograd.grad(y.sin().sum(), x, create_graph=True)[0]

    assert gradgradcheck(input_gradient, args)


def _net(bn: type[nn.Module], momentum: float | None = 0.1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), bn(4, momentum=momentum), nn.Tanh(),
                         nn.Conv2d(4, 4, 3, padding=1), bn(4, momentum=momentum), nn.Tanh(),
                         nn.Flatten(), nn.Linear(4 * 5 * 5, 3)).double()


def _penalized_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One backward of task loss + double backprop ||grad_x loss||^2; returns the output."""
    x = x.detach().requires_grad_()
    out = net(x)
    loss = F.cross_entropy(out, y)
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + g.square().sum()).backward()
    return out


@pytest.mark.parametrize("momentum,layout", [(0.1, torch.contiguous_format),
                                             (None, torch.channels_last)])
def test_converted_net_matches_torch_in_a_double_backprop_step(
        momentum: float | None, layout: torch.memory_format) -> None:
    reference = _net(nn.BatchNorm2d, momentum).to(memory_format=layout)
    converted = convert_batchnorm(copy.deepcopy(reference))
    assert sum(isinstance(m, BatchNorm2d) for m in converted.modules()) == 2
    for step in range(3):
        torch.manual_seed(step)
        x = torch.randn(6, 2, 5, 5, dtype=torch.float64).to(memory_format=layout)
        y = torch.randint(0, 3, (6,))
        for net in (reference, converted):
            net.zero_grad()
        torch.testing.assert_close(_penalized_step(converted, x, y),
                                   _penalized_step(reference, x, y), rtol=1e-12, atol=1e-12)
        for (name, a), b in zip(converted.named_parameters(), reference.parameters(),
                                strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)
    for a, b in zip(converted.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # running stats, batch count
    for net in (reference, converted):
        net.eval()
    x = torch.randn(6, 2, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(_penalized_step(converted, x, torch.zeros(6, dtype=torch.long)),
                               _penalized_step(reference, x, torch.zeros(6, dtype=torch.long)))
    with torch.no_grad():
        torch.testing.assert_close(converted(x), reference(x))


def test_first_order_gradients_match_torch_in_float32() -> None:
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(3)
    ref.weight.data.uniform_(0.5, 1.5)
    ref.bias.data.uniform_(-1, 1)
    mine = convert_batchnorm(copy.deepcopy(ref))
    x = torch.randn(8, 3, 5) * 3 + 2
    grads = []
    for bn in (ref, mine):
        xr = x.clone().requires_grad_()
        out = bn(xr)
        grads.append((out, *torch.autograd.grad(out.tanh().sum(), [xr, bn.weight, bn.bias])))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_bf16_autocast_keeps_torchs_dtypes_and_values() -> None:
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(3)
    mine = convert_batchnorm(copy.deepcopy(ref))
    x = torch.randn(4, 3, 4, 4).bfloat16()
    for training in (True, False):
        ref.train(training)
        mine.train(training)
        outs = []
        for bn in (ref, mine):
            xr = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = bn(xr)
                (g,) = torch.autograd.grad(out.float().square().sum(), xr, create_graph=True)
                (gw,) = torch.autograd.grad(g.float().square().sum(), bn.weight)
            outs.append((out, g, gw))
        for a, b in zip(*outs, strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_state_dict_loads_both_ways_and_conversion_keeps_the_tensors() -> None:
    reference = _net(nn.BatchNorm2d)
    reference(torch.randn(4, 2, 5, 5, dtype=torch.float64))  # non-trivial running stats
    reference.eval()
    params = list(reference.parameters())
    converted = gradreg.convert_batchnorm(reference)
    assert all(a is b for a, b in zip(converted.parameters(), params, strict=True))
    assert not converted.training and next(converted.buffers()).dtype == torch.float64
    fresh_torch, fresh_mine = _net(nn.BatchNorm2d), _net(BatchNorm2d)
    assert fresh_torch.state_dict().keys() == fresh_mine.state_dict().keys()
    fresh_mine.load_state_dict(reference.state_dict())
    fresh_torch.load_state_dict(fresh_mine.state_dict())
    for a, b in zip(fresh_torch.state_dict().values(), reference.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("affine,track", [(False, True), (True, False)])
def test_options_match_torch(affine: bool, track: bool) -> None:
    ref = nn.BatchNorm1d(3, affine=affine, track_running_stats=track).double()
    mine = convert_batchnorm(copy.deepcopy(ref))
    assert isinstance(mine, BatchNorm1d) and isinstance(mine, nn.BatchNorm1d)
    x = torch.randn(7, 3, dtype=torch.float64)
    for training in (True, False):  # without running stats, eval also uses the batch's
        ref.train(training)
        mine.train(training)
        torch.testing.assert_close(mine(x), ref(x))
    assert list(mine.state_dict()) == list(ref.state_dict())


def test_one_value_per_channel_is_refused_like_torch() -> None:
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        BatchNorm1d(3)(torch.randn(1, 3))


class _FullSizeOps(TorchDispatchMode):
    """Counts the ops that read or write a tensor of ``numel`` elements (views excluded)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [t for t in (*args, *outs) if isinstance(t, torch.Tensor)]
        if (func.overloadpacket not in (torch.ops.aten.view, torch.ops.aten.expand)
                and any(t.numel() >= self.numel for t in tensors)):
            self.count += 1
        return out


def _double_backward_passes(bn: nn.Module) -> int:
    x = torch.randn(8, 4, 5, 5, requires_grad=True)
    (g,) = torch.autograd.grad(bn(x).sum(), x, create_graph=True)
    with _FullSizeOps(x.numel()) as counter:
        torch.autograd.grad(g.square().sum(), [x, bn.weight], allow_unused=True)
    return counter.count


@pytest.mark.parametrize("training", [True, False])
def test_double_backward_makes_fewer_full_size_passes_than_torch(training: bool) -> None:
    """The point of the module: memory-bound passes over activations, counted (not timed)."""
    ref = nn.BatchNorm2d(4).train(training)
    mine = convert_batchnorm(copy.deepcopy(ref))
    ours, theirs = _double_backward_passes(mine), _double_backward_passes(ref)
    assert ours < theirs / 2  # 22 against 46 in training mode, 7 against 15 in eval (torch 2.13)
