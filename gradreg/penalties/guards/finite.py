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
    points: int = 1  # how many leading entries are the points' (where there are outputs)
    outputs: bool = True  # whether an entry for the outputs follows them


#: What each entry of a recorded value is, in the order causes come (a NaN in the points makes
#: the outputs, the penalty and the weighted penalty NaN too: the first one found is reported).
ENTRIES = ("points", "outputs", "penalty", "weighted")


class FiniteCheck:
    """Record, for each call of a penalty, whether its points, its outputs, its value and its
    weighted value are finite; raise :class:`~gradreg.NonFiniteError` (a
    :class:`~gradreg.GradientError`) for the first call with a non-finite one as soon as it can be
    read without a device sync.

    One fused reduction, ``torch._foreach_norm(..., inf)``, takes the largest magnitude of each
    of them (finite exactly when every element is: a NaN or an Inf anywhere makes it NaN or
    Inf, and a maximum cannot overflow, whatever the magnitude of finite elements), and one
    ``stack`` puts them in one tensor (of their widest dtype: a finite float64 value stays
    finite): two kernels per call, read on the host at once on the CPU, and on CUDA by one
    asynchronous copy, read once an event says it has completed. Under CUDA graph capture
    nothing is copied or read during the call: the flags stay on the device, the latest are
    read by :meth:`settle` (after a replay; one sync).
    """

    def __init__(self) -> None:
        self._recorded: deque[_Recorded] = deque()
        self._captured: _Recorded | None = None  # the flags of a call under graph capture
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
        tensors = []
        for t in points:  # a loop, not a comprehension: this runs on every penalty call
            tensors.append(t.detach())
        if outputs is not None:
            tensors.append(outputs.detach())
        tensors += [value.detach(), weighted.detach()]
        flags = torch.stack(torch._foreach_norm(tensors, math.inf))
        if value.device.type != "cuda":  # read now, on the host
            self.settle(wait=False)  # the calls recorded on a device before this one
            self._raise_first(self._calls, flags.tolist(), factor, bool(points), len(points),
                              outputs is not None)
            return
        if torch.cuda.is_current_stream_capturing():  # read after the replay, by settle()
            self._captured = _Recorded(self._calls, flags, lambda: True, lambda: None, factor,
                                       bool(points), len(points), outputs is not None)
            return
        host = flags.to("cpu", non_blocking=True)  # pinned, asynchronous
        event = torch.cuda.Event()
        event.record()
        self._recorded.append(_Recorded(self._calls, host, event.query, event.synchronize,
                                        factor, bool(points), len(points), outputs is not None))
        self.settle(wait=False)

    def settle(self, wait: bool = True) -> None:
        """Read the recorded values in call order (all of them with ``wait``, which syncs; else
        those already copied) and raise for the first call that has a non-finite one. With
        ``wait``, the flags of the latest call captured in a CUDA graph too: those of its latest
        replay (call it after replaying)."""
        if wait and self._captured is not None:
            self._recorded.append(self._captured)
        while self._recorded and (wait or self._recorded[0].ready()):
            recorded = self._recorded.popleft()
            recorded.wait()
            values = recorded.host_value.reshape(-1).tolist()
            if len(values) == 1:  # a bare value: the penalty
                values = values * 2
            self._raise_first(recorded.call, values, recorded.factor, recorded.points_checked,
                              recorded.points, recorded.outputs)

    def _raise_first(self, call: int, values: list[float], factor: float, points_checked: bool,
                     points: int = 1, outputs: bool = True) -> None:
        """Raise for the first non-finite entry of call ``call``'s ``values``: those of its
        ``points`` tensors, of its outputs (where ``outputs``), the penalty and the weighted one;
        the last two alone where the call had neither points nor outputs."""
        if len(values) > 2:  # as the entries of ENTRIES: the points' first non-finite one
            values = [next((v for v in values[:points] if not math.isfinite(v)), 0.0),
                      values[points] if outputs else 0.0, *values[-2:]]
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
        return {"_recorded": deque(), "_captured": None, "_calls": self._calls}


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
