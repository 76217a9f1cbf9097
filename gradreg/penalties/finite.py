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

from gradreg.autograd import GradientError

__all__ = ["FiniteCheck"]


@dataclass
class _Recorded:
    call: int
    host_value: Tensor  # a CPU scalar, possibly still being written by an asynchronous copy
    ready: Callable[[], bool]  # the copy has completed (no wait)
    wait: Callable[[], None]  # block until it has


class FiniteCheck:
    """Record the detached scalar value of each call of a penalty; raise
    :class:`~gradreg.GradientError` for the first non-finite one as soon as it can be read
    without a device sync."""

    def __init__(self) -> None:
        self._recorded: deque[_Recorded] = deque()
        self._calls = 0

    def __call__(self, value: Tensor) -> None:
        """Record ``value`` (this call's) and raise for any recorded value known not finite."""
        self._calls += 1
        if value.device.type == "cuda":
            host = value.detach().to("cpu", non_blocking=True)  # pinned, asynchronous
            event = torch.cuda.Event()
            event.record()
            self._recorded.append(_Recorded(self._calls, host, event.query, event.synchronize))
        else:
            self._recorded.append(_Recorded(self._calls, value.detach().cpu(), lambda: True,
                                            lambda: None))
        self.settle(wait=False)

    def settle(self, wait: bool = True) -> None:
        """Read the recorded values in call order (all of them with ``wait``, which syncs; else
        those already copied) and raise for the first that is NaN or Inf."""
        while self._recorded and (wait or self._recorded[0].ready()):
            recorded = self._recorded.popleft()
            recorded.wait()
            value = recorded.host_value.item()
            if not math.isfinite(value):
                self._recorded.clear()
                late = "" if recorded.call == self._calls else (
                    f" (found at call {self._calls}: on a GPU the check reads the value "
                    "asynchronously, after that call's optimizer step)")
                raise GradientError(
                    f"the penalty of call {recorded.call} is {value} (not finite){late}: the "
                    "outputs or the points contain NaN/Inf, or the model diverged. Check the "
                    "batch with torch.isfinite(x).all(), lower the learning rate, or guard the "
                    "step (check_finite=False lets the value through)."
                )

    def __getstate__(self) -> dict:
        """Copies and pickles start with nothing pending (events cannot be copied)."""
        return {"_recorded": deque(), "_calls": self._calls}
