"""Every number of the source notes (shared seeds 000-003), reproduced through gradreg's API."""

import pytest
import torch
from torch import nn

import gradreg


class SeedNet(nn.Module):
    """Seed 001: y = ((w1 * x) * w2 + b2) ** 2 with w1 = 3, w2 = 2, b2 = 6."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(1, 1, bias=False)
        self.linear2 = nn.Linear(1, 1, bias=True)
        with torch.no_grad():
            self.linear1.weight.fill_(3.0)
            self.linear2.weight.fill_(2.0)
            self.linear2.bias.fill_(6.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.linear1(x)).pow(2)


def grads(net: SeedNet) -> tuple[float, float, float]:
    return (net.linear1.weight.grad.item(), net.linear2.weight.grad.item(),
            net.linear2.bias.grad.item())


@pytest.fixture
def net() -> SeedNet:
    return SeedNet()


X = torch.tensor([[4.0]])


def test_x_pow_7_derivatives_are_7_42_210() -> None:
    x = torch.ones(1, requires_grad=True)
    y = x**7
    assert [gradreg.nth_derivative(y, x, n).item() for n in (1, 2, 3)] == [7.0, 42.0, 210.0]
    assert x.grad is None  # seed 000 section 4: autograd.grad accumulates nothing


def test_nth_derivative_keeps_graph_and_handles_vanishing_orders() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    d3 = gradreg.nth_derivative(x**3, x, 3)
    assert torch.equal(d3.detach(), torch.tensor([6.0, 6.0]))
    assert torch.equal(gradreg.nth_derivative(x**3, x, 4), torch.zeros(2))
    d2 = gradreg.nth_derivative(x**4, x, 2)  # 12 x^2, differentiable again
    d2.sum().backward()
    assert torch.equal(x.grad, torch.tensor([24.0, 48.0]))
    assert gradreg.nth_derivative(x**2, x, 0) is not None
    with pytest.raises(gradreg.GradientError, match="non-negative"):
        gradreg.nth_derivative(x**2, x, -1)


def test_forward_values_and_dy_dl_120_via_capture(net: SeedNet) -> None:
    with gradreg.capture(net, "linear1") as acts:
        y = net(X)
    hidden = acts["linear1"]  # the seed's intermediate l = w1 * x
    assert (hidden.item(), y.item()) == (12.0, 900.0)
    assert not hidden.is_leaf
    assert gradreg.gradient(y, hidden).item() == 120.0


def test_penalty_f_backward_gives_32_108_4(net: SeedNet) -> None:
    with gradreg.capture(net, "linear1") as acts:
        y = net(X)
    f = gradreg.gradient(y, acts["linear1"])
    f.backward()
    assert grads(net) == (32.0, 108.0, 4.0)


def test_y_backward_alone_gives_480_720_60(net: SeedNet) -> None:
    net(X).backward()
    assert grads(net) == (480.0, 720.0, 60.0)


def test_y_and_f_accumulate_to_512_828_64(net: SeedNet) -> None:
    with gradreg.capture(net, "linear1") as acts:
        y = net(X)
    f = gradreg.gradient(y, acts["linear1"])
    f.backward(retain_graph=True)
    y.backward()
    assert grads(net) == (512.0, 828.0, 64.0)


def test_regularized_backward_gives_exactly_loss_plus_penalty(net: SeedNet) -> None:
    for _ in range(3):  # stale .grad from earlier steps must not leak in
        with gradreg.capture(net, "linear1") as acts:
            y = net(X)
        f = gradreg.gradient(y, acts["linear1"])
        total = gradreg.regularized_backward(y.sum(), [f.sum()], net.parameters())
        assert total.item() == 1020.0
        assert grads(net) == (512.0, 828.0, 64.0)


def test_second_derivative_wrt_w1_is_128(net: SeedNet) -> None:
    first = gradreg.gradient(net(X), net.linear1.weight)
    assert first.item() == 480.0
    assert gradreg.gradient(first, net.linear1.weight).item() == 128.0


def test_gradient_leaves_every_grad_untouched(net: SeedNet) -> None:
    """Seed 001 In [21]-[23]: autograd.grad returns 480 but net.linear1.weight.grad stays None."""
    y = net(X)
    g = gradreg.gradient(y, [net.linear1.weight, net.linear2.weight, net.linear2.bias])
    assert [t.item() for t in g] == [480.0, 720.0, 60.0]
    assert all(p.grad is None for p in net.parameters())


def test_grad_accumulates_across_backward_calls_unless_zeroed() -> None:
    """Seed 000 section 1: 7 then 14 without zeroing; 7 and 7 with zeroing."""
    x = torch.ones(1, requires_grad=True)
    y = x**7
    y.backward(retain_graph=True)
    y.backward()
    assert x.grad.item() == 14.0
    x = torch.ones(1, requires_grad=True)
    y = x**7
    gradreg.regularized_backward(y, [], [x])
    y = x**7
    gradreg.regularized_backward(y, [], [x])
    assert x.grad.item() == 7.0


def test_seed_002_scalar_backward_values() -> None:
    x = torch.tensor(2.0, requires_grad=True)
    y = torch.tensor(3.0, requires_grad=True)
    gx, gy = gradreg.gradient(x**2 + y, (x, y))
    assert (gx.item(), gy.item()) == (4.0, 1.0)
