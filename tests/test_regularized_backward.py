"""regularized_backward of a loss that does not require grad: one line naming the cause."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradreg
from gradreg import GradientError


def test_a_loss_without_grad_is_refused_with_the_cause_and_the_fix() -> None:
    net = nn.Linear(3, 1)
    x = torch.randn(4, 3)
    with torch.no_grad():
        loss = net(x).mean()
    with pytest.raises(GradientError, match=r"^the loss does not require grad, so there is "
                                            r"nothing to backpropagate: .*torch\.no_grad"):
        gradreg.regularized_backward(loss, [], net.parameters())
    with pytest.raises(GradientError, match="the loss and penalties.0. do not require grad"):
        gradreg.regularized_backward(loss, [loss.detach()], net.parameters())


def test_a_detached_loss_with_a_penalty_that_requires_grad_is_backpropagated() -> None:
    """Only a total without grad is refused: the penalty's gradient, 2 * w for w . w."""
    net = nn.Linear(3, 1, bias=False)
    total = gradreg.regularized_backward(torch.tensor(1.0), [net.weight.square().sum()],
                                         net.parameters())
    torch.testing.assert_close(net.weight.grad, 2 * net.weight.detach())
    assert total.item() == pytest.approx(1.0 + net.weight.square().sum().item())


def test_regularized_backward_with_all_parameters_frozen_is_refused() -> None:
    frozen = torch.tensor(2.0, dtype=torch.float64)  # requires_grad=False
    other = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)  # in the graph, not given
    loss = frozen * other
    with pytest.raises(GradientError, match=r"all 1 parameters given are frozen"):
        gradreg.regularized_backward(loss, [], [frozen])
    with pytest.raises(GradientError, match="no parameters were given"):
        gradreg.regularized_backward(loss, [], [])
    assert other.grad is None and frozen.grad is None
    given = torch.tensor(5.0, dtype=torch.float64, requires_grad=True)
    gradreg.regularized_backward(loss * given, [], [frozen, given])
    assert given.grad.item() == 6.0 and other.grad is None  # d(2 * 3 * given)/d given
