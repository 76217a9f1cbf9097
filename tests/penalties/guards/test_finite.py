"""check_finite without a host sync: immediate on the CPU, read once copied on CUDA."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from gradreg import GradientError, NonFiniteError
from gradreg.penalties import (
    LossAt,
    as_points,
    make_penalty,
    param_grad_norm,
    r1,
)
from gradreg.penalties.guards.finite import FiniteCheck, _Recorded

NAN = torch.tensor(float("nan"))


def test_cpu_values_are_checked_at_once_naming_the_call() -> None:
    check = FiniteCheck()
    check(torch.tensor(1.0))
    with pytest.raises(NonFiniteError, match=r"penalty of call 2 is nan \(not finite\): the"):
        check(NAN)  # a GradientError of its own kind: a sweep fails only the diverged trial
    check(torch.tensor(2.0))  # reported once; the check goes on


def test_an_asynchronous_copy_is_read_only_once_complete() -> None:
    """A value whose copy is still running (as on CUDA) is not waited for; the call after its
    copy completes raises, naming both calls; ``settle`` waits (here: marks it done)."""
    copied, waited = [False], []
    check = FiniteCheck()
    check(torch.tensor(1.0))
    check._calls += 1  # call 2 records its value asynchronously
    check._recorded.append(_Recorded(2, NAN, lambda: copied[0], lambda: waited.append(2)))
    check(torch.tensor(1.0))  # call 3: the copy of call 2 is not done, nothing is waited for
    assert waited == []
    copied[0] = True
    with pytest.raises(GradientError, match=r"call 2 is nan \(not finite\) \(found at call 4"):
        check(torch.tensor(1.0))
    check._recorded.append(_Recorded(5, NAN, lambda: False, lambda: waited.append(5)))
    with pytest.raises(GradientError, match="call 5 is nan"):
        check.settle()
    assert waited == [2, 5]


def test_penalties_with_values_in_flight_can_be_copied() -> None:
    """A pending record holds a CUDA event, which cannot be copied (a lock stands in for it
    here): a deep copy or pickle of the penalty starts with nothing pending."""
    penalty = make_penalty("r1")
    x = torch.randn(4, 3, requires_grad=True)
    penalty(x.sin().sum(1), x)
    lock = threading.Lock()
    penalty.finite_check._recorded.append(_Recorded(2, NAN, lock.locked, lock.acquire))
    with pytest.raises(TypeError):
        copy.deepcopy(lock)
    clone = copy.deepcopy(penalty)
    assert clone.finite_check._calls == 1 and not clone.finite_check._recorded
    assert len(penalty.finite_check._recorded) == 1


def test_finite_float64_values_beyond_float32_range_are_not_reported() -> None:
    """Points of 1e300, D(x) = 1e-3 * sum(x): ||g||^2 = 2e-6, R1 = 5 * 2e-6 = 1e-5."""
    x = as_points(torch.full((2, 2), 1e300, dtype=torch.float64))
    assert r1()(1e-3 * x.sum(1), x).item() == pytest.approx(1e-5, rel=1e-12)
    check = FiniteCheck()
    check(torch.tensor(1e300, dtype=torch.float64), points=(x,))  # finite in float64: 1e300
    with pytest.raises(NonFiniteError, match="points of call 2"):
        check(torch.tensor(1.0, dtype=torch.float64), points=(torch.tensor([1e300, float("inf")]),))
    with pytest.raises(NonFiniteError, match="penalty of call 3 is inf"):
        check(torch.tensor(float("inf"), dtype=torch.float64))


@pytest.mark.parametrize(("method", "message"), [
    ("double_backward", r"the outputs of call 2 contain NaN or Inf: the model overflowed"),
    ("finite_difference", r"the penalty of call 2 is nan \(not finite\)")])
def test_a_non_finite_parameter_makes_a_parameter_penalty_non_finite(method: str,
                                                                     message: str) -> None:
    """A penalty on points="parameters" checks no parameter itself: a NaN weight makes the
    loss (the outputs of double backward, not said to come from finite points) or the loss's
    gradient and so the value (finite difference) NaN, reported at that call."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(8, 3)
    penalty = param_grad_norm(0.1, method=method)

    def loss() -> torch.Tensor:
        return model(x).square().mean()

    params = list(model.parameters())
    penalty(LossAt.run(loss, x) if method != "double_backward" else loss(), params)
    with torch.no_grad():
        model[2].weight[0, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=message):
        penalty(LossAt.run(loss, x) if method != "double_backward" else loss(), params)
