"""Non-finite penalty values, found without stalling an accelerator's stream.

Reading a device tensor on the host (``bool(t)``, ``t.item()``) waits for every kernel queued so
far: once per training step that idles the GPU while the host launches the rest of the step. So
on CUDA each value is copied to (pinned) host memory asynchronously, with an event recorded
behind the copy, and every later call reads the values whose events have completed
(``Event.query()`` never waits). A non-finite value is then reported at a later call, normally
the next one, naming the call that produced it; the optimizer step of that call has used it.
:meth:`FiniteCheck.settle` waits for every recorded value (one sync), e.g. at the end of an
epoch. On the CPU, and on devices without this event API, the check is immediate, before the
value is used.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from gradreg.autograd import NonFiniteError

__all__ = ["FiniteCheck"]


@dataclass
class _Recorded:
    call: int
    host_value: Tensor  # on the CPU, possibly still being written by an asynchronous copy
    ready: Callable[[], bool]  # the copy has completed (no wait)
    wait: Callable[[], None]  # block until it has
    factor: float = 1.0  # what multiplied the value: weight * every * gain
    points_checked: bool = True  # whether points were given (a parameter penalty's are not)


#: What each entry of a recorded value is, in the order causes come (a NaN in the points makes
#: the outputs, the penalty and the weighted penalty NaN too: the first one found is reported).
ENTRIES = ("points", "outputs", "penalty", "weighted")


class FiniteCheck:
    """Record, for each call of a penalty, whether its points, its outputs, its value and its
    weighted value are finite; raise :class:`~gradreg.NonFiniteError` (a
    :class:`~gradreg.GradientError`) for the first call with a non-finite one as soon as it can be
    read without a device sync.

    The points and the outputs are each reduced on their device to one number, 0 exactly when
    all their elements are finite and NaN otherwise (:func:`_nonfinite`: no overflow, whatever
    their magnitude); the two and the two values travel in one 4-element tensor of the value's
    dtype (at least float32, so a finite float64 value above float32's range stays finite; a
    call given neither points nor outputs, a parameter penalty's, sends the two values alone):
    on CUDA one asynchronous copy per call, read once an event says it has completed.
    """

    def __init__(self) -> None:
        self._recorded: deque[_Recorded] = deque()
        self._calls = 0

    def __call__(self, value: Tensor, *, points: tuple[Tensor, ...] = (),
                 outputs: Tensor | None = None, weighted: Tensor | None = None,
                 factor: float = 1.0) -> None:
        """Record this call and raise for any recorded call known to be non-finite.

        ``value``: the unweighted penalty; ``weighted``: what the call returns,
        ``factor * value``; ``points`` and ``outputs``: the tensors it was computed from.
        """
        self._calls += 1
        weighted = value if weighted is None else weighted
        checked = bool(points)
        if value.device.type != "cuda":  # read now, on the host
            self.settle(wait=False)  # the calls recorded on a device before this one
            values = [value.item(), weighted.item()]
            if points or outputs is not None:
                values[:0] = [_nonfinite(t, value.device, torch.float64).item()
                              for t in (points, () if outputs is None else (outputs,))]
            self._raise_first(self._calls, values, factor, checked)
            return
        dtype = torch.promote_types(value.dtype, torch.float32)
        entries = [value.detach().reshape(()).to(dtype), weighted.detach().reshape(()).to(dtype)]
        if points or outputs is not None:  # else two entries: the penalty and the weighted one
            entries[:0] = [_nonfinite(points, value.device, dtype),
                           _nonfinite(() if outputs is None else (outputs,), value.device, dtype)]
        host = torch.stack(entries).to("cpu", non_blocking=True)  # pinned, asynchronous
        event = torch.cuda.Event()
        event.record()
        self._recorded.append(_Recorded(self._calls, host, event.query, event.synchronize,
                                        factor, checked))
        self.settle(wait=False)

    def settle(self, wait: bool = True) -> None:
        """Read the recorded values in call order (all of them with ``wait``, which syncs; else
        those already copied) and raise for the first call that has a non-finite one."""
        while self._recorded and (wait or self._recorded[0].ready()):
            recorded = self._recorded.popleft()
            recorded.wait()
            values = recorded.host_value.reshape(-1).tolist()
            if len(values) == 1:  # a bare value: the penalty
                values = values * 2
            self._raise_first(recorded.call, values, recorded.factor, recorded.points_checked)

    def _raise_first(self, call: int, values: list[float], factor: float,
                     points_checked: bool) -> None:
        """Raise for the first non-finite entry of call ``call``'s ``values`` (those of
        :data:`ENTRIES`, or the last two of them where the call had no points and no outputs)."""
        values = [0.0] * (len(ENTRIES) - len(values)) + values
        found = next((entry for entry, v in zip(ENTRIES, values, strict=True)
                      if not math.isfinite(v)), None)
        if found is not None:
            self._recorded.clear()
            late = "" if call == self._calls else (
                f" (found at call {self._calls}: on a GPU the check reads the value "
                "asynchronously, after that call's optimizer step)")
            raise NonFiniteError(_message(found, call, factor, points_checked, values, late))

    def __getstate__(self) -> dict:
        """Copies and pickles start with nothing pending (events cannot be copied)."""
        return {"_recorded": deque(), "_calls": self._calls}


def _nonfinite(tensors: tuple[Tensor, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    """0 where every element of ``tensors`` is finite, else NaN (on ``device``, in ``dtype``).

    The smallest and largest element of each tensor, in its own dtype, times 0: a NaN or an Inf
    anywhere makes the minimum or the maximum NaN or +-Inf, and that times 0 is NaN. One
    reduction per tensor (``aminmax``), no elementwise mask, and no sum, which could overflow
    for finite values (a float32 sum of float64 values above 3.4e38 would).
    """
    zero = torch.zeros((), dtype=dtype, device=device)
    for t in tensors:
        if t.numel():
            low, high = torch.aminmax(t.detach())
            zero = zero + (low * 0 + high * 0).to(device=device, dtype=dtype)
    return zero


def _message(found: str, call: int, factor: float, points_checked: bool, values: list[float],
             late: str) -> str:
    if found == "points":
        return (
            f"the points of call {call} contain NaN or Inf{late}: the penalty and every parameter "
            "gradient it reaches would be NaN. Find the samples with "
            "(~torch.isfinite(x)).flatten(1).any(1) and drop or repair them (a corrupt image, "
            "a generator that diverged), or guard the step (check_finite=False lets it through)."
        )
    if found == "outputs":
        return (
            f"the outputs of call {call} contain NaN or Inf"
            f"{' although the points are finite' if points_checked else ''}"
            f"{late}: the model overflowed or diverged (a mean over an empty batch is NaN too). "
            "Lower the learning rate, check the loss for empty batches, or guard the step "
            "(check_finite=False lets it through)."
        )
    if found == "penalty":
        return (
            f"the penalty of call {call} is {values[2]} (not finite){late}: the "
            "outputs or the points contain NaN/Inf, or the model diverged. Check the "
            "batch with torch.isfinite(x).all(), lower the learning rate, or guard the "
            "step (check_finite=False lets the value through)."
        )
    return (
        f"the penalty of call {call} is {values[3]} after weighting (not finite){late}: its "
        f"unweighted value {values[2]:.6g} times weight * every * gain = {factor:.6g} "
        "overflows the value's dtype. Lower the weight, or compute the penalty in float32 "
        "(outside autocast, or on a float32 model)."
    )
