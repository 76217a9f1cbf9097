r"""One set of random draws for every forward of a penalty call: the random state, captured and
replayed.

A penalty that runs the model more than once per call (the perturbation estimate, finite
differences, the Hessian penalty, the spectral norm's power iteration) differences or
differentiates *one* function of the points. A random layer in training mode (dropout and its
variants, ``F.dropout``, RReLU, stochastic depth, ``torch.rand*`` in ``forward``) draws a new mask
at every forward, so without care :math:`(f(x + h; m') - f(x; m))/h` measures the change of mask
:math:`m \to m'`, not of :math:`x`, and is larger than the penalty by orders of magnitude.

Every forward of one call (:class:`Replaying`) therefore starts from the same state of torch's
global generators, the CPU's and those of the points' accelerators: the first forward draws as
usual (the generators advance once, as for a single forward), every later one runs inside
``torch.random.fork_rng`` from the state the first began with, so it draws the same numbers in the
same order (the same mask, as long as it draws for the same shapes: the same batch) and leaves the
generators as they were. With a fixed mask :math:`m` the penalty is that of the deterministic
function :math:`f(\cdot\,; m)`, the one the exact double backward of the first forward
differentiates; over the draws of :math:`m` it is unbiased as that one is.

Where the forward at the points themselves is the task's, run before the penalty is called, its
state must be captured before that forward: :class:`SharedForward` carries the outputs and that
state (:meth:`SharedForward.run` does both). A callable that hands back outputs computed
elsewhere without their state is refused once a later forward turns out to draw random numbers
(the masks could not be the same).

Not replayed: generators other than torch's global ones (a ``torch.Generator`` of the model's
own, Python's ``random``, NumPy's), and those of devices the points are not on (the replicas of
``nn.DataParallel``); a parameter shift refuses a forward that draws from them
(:class:`UnreplayedDraws`, on its first call). A forward on another part of the batch draws
other numbers for
the same sample: the chunked penalty refuses models that draw
(:class:`~gradreg.penalties.methods.chunks.InChunks`).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from gradreg.autograd import GradientError

__all__ = ["GeneratorState", "Replaying", "SharedForward", "UnreplayedDraws"]


@dataclass(frozen=True, eq=False)
class GeneratorState:
    """The state of torch's global generators at one moment: the CPU's, and that of each
    accelerator device in ``devices`` (of type ``device_type``).

    Examples:
        >>> import torch
        >>> from gradreg.penalties import GeneratorState
        >>> state = GeneratorState.capture()
        >>> first = torch.rand(2)
        >>> state.moved()
        True
        >>> with state.replayed():  # the same draws again; the generator restored after
        ...     again = torch.rand(2)
        >>> torch.equal(first, again)
        True
    """

    cpu: Tensor
    device_type: str
    devices: tuple[int, ...]
    accelerator: tuple[Tensor, ...]

    @classmethod
    def capture(cls, *tensors: object) -> GeneratorState:
        """The state now, of the CPU and of the accelerator devices ``tensors`` live on (the
        points of a forward; objects other than tensors are ignored). No device sync: the
        states are read on the host."""
        devices = sorted({t.device for t in tensors
                          if isinstance(t, Tensor) and t.device.type not in ("cpu", "meta")},
                         key=str)
        device_type = devices[0].type if devices else "cuda"
        indices = tuple(d.index if d.index is not None else 0 for d in devices
                        if d.type == device_type)
        module = torch.get_device_module(device_type) if indices else None
        return cls(torch.get_rng_state(), device_type, indices,
                   tuple(module.get_rng_state(i) for i in indices) if module else ())

    def moved(self) -> bool:
        """Whether the generators have drawn since this state (a forward since drew random
        numbers)."""
        now = GeneratorState.capture()
        if not torch.equal(now.cpu, self.cpu):
            return True
        module = torch.get_device_module(self.device_type) if self.devices else None
        return any(not torch.equal(module.get_rng_state(i), state)
                   for i, state in zip(self.devices, self.accelerator, strict=True))

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block from this state; the generators are restored after it (what
        ``torch.random.fork_rng`` does, for the CPU and :attr:`devices` only)."""
        module = torch.get_device_module(self.device_type) if self.devices else None
        before = GeneratorState(torch.get_rng_state(), self.device_type, self.devices,
                                tuple(module.get_rng_state(i) for i in self.devices)
                                if module else ())
        self._set()
        try:
            yield
        finally:
            before._set()

    def _set(self) -> None:
        """Set the generators to this state."""
        torch.set_rng_state(self.cpu)
        if self.devices:
            module = torch.get_device_module(self.device_type)
            for i, state in zip(self.devices, self.accelerator, strict=True):
                module.set_rng_state(state, i)


class UnreplayedDraws(TorchFunctionMode):
    """Inside: the sources of random numbers that :class:`GeneratorState` does not replay and
    the block drew from, in :attr:`drawn` (their names) once it is left: torch calls given a
    ``generator=`` of their own (a ``torch.Generator`` of the model's), Python's ``random`` and
    NumPy's global generator (their states compared on entry and exit). Every torch call of
    the block goes through Python: for one forward, not every step's."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn: list[str] = []

    def __enter__(self) -> UnreplayedDraws:
        numpy = sys.modules.get("numpy")
        self._python = random.getstate()
        self._numpy = numpy.random.get_state(legacy=False) if numpy else None
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if random.getstate() != self._python:
            self.drawn.append("Python's random")
        if self._numpy is not None and _numpy_state_moved(self._numpy):
            self.drawn.append("numpy.random")

    def __torch_function__(self, func: Callable, types: object, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        if kwargs.get("generator") is not None:
            self.drawn.append(f"a torch.Generator of its own ({getattr(func, '__name__', func)}"
                              " given generator=)")
        return func(*args, **kwargs)


def _numpy_state_moved(before: dict) -> bool:
    """Whether NumPy's global generator drew since its state ``before``
    (``get_state(legacy=False)``: the bit generator's position and key)."""
    now = sys.modules["numpy"].random.get_state(legacy=False)
    return (now["state"]["pos"] != before["state"]["pos"]
            or not (now["state"]["key"] == before["state"]["key"]).all()
            or now["has_gauss"] != before["has_gauss"])


@dataclass(frozen=True, eq=False)
class SharedForward:
    r"""A per-sample function whose forward at ``points`` already ran (the task's forward):
    called on ``points`` itself (the same tensor object) it hands back ``outputs``, elsewhere it
    runs ``fn``. ``state``: the random state that forward began with (:meth:`GeneratorState.capture`
    just before it), which a penalty replays for its other forwards; ``None`` where unknown
    (refused with a random model).

    Pass it as a penalty's ``outputs`` (``penalty(shared, x)``), e.g.
    ``shared = SharedForward.run(critic, x)``, the task loss from ``shared.outputs``: it is the
    one object every method takes (module or function, points, the outputs already computed,
    the replayable random state), and the method decides what to run of it (double backward
    differentiates ``outputs``, the finite difference and the perturbation estimate take them
    at the points and replay ``state`` elsewhere, ``subsample``, ``chunks`` and the kinds run
    ``fn``; :meth:`GradientPenalty.forward <gradreg.penalties.GradientPenalty.forward>`).

    Examples:
        R1 without a double backward, sharing the critic's forward at the reals with the task
        loss (a linear critic: the estimate is exactly :math:`(\varepsilon \cdot w)^2`):

        >>> import torch
        >>> from gradreg.penalties import SharedForward, approx_r1, as_points
        >>> critic = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Flatten(0))
        >>> x = as_points(torch.randn(8, 2))
        >>> shared = SharedForward.run(critic, x)
        >>> task_loss = torch.nn.functional.softplus(-shared.outputs).mean()
        >>> loss = task_loss + approx_r1(10.0)(shared, x)
        >>> shared(x) is shared.outputs  # the points themselves: no second forward
        True
    """

    fn: Callable[..., Tensor]
    points: Tensor
    outputs: Tensor
    state: GeneratorState | None

    @classmethod
    def run(cls, fn: Callable[..., Tensor], points: Tensor, *args: Tensor) -> SharedForward:
        """Capture the random state, then run ``fn(points, *args)``."""
        state = GeneratorState.capture(points, *args)
        return cls(fn, points, fn(points, *args), state)

    def with_args(self, args: tuple[Tensor, ...]) -> SharedForward:
        """The same shared forward as a function of the points alone, ``args`` (per-sample
        arguments such as labels) appended to every call of ``fn``."""
        if not args:
            return self
        fn = self.fn
        return SharedForward(lambda *points: fn(*points, *args), self.points, self.outputs,
                             self.state)

    def shares(self, args: tuple[object, ...]) -> bool:
        """Whether a call with ``args`` is the shared forward (its first argument is
        ``points``)."""
        return bool(args) and args[0] is self.points

    def __call__(self, *args: Tensor) -> Tensor:
        return self.outputs if self.shares(args) else self.fn(*args)


class Replaying:
    """``fn`` for one penalty call: every forward draws the random numbers of one reference
    forward, the :class:`SharedForward`'s where ``fn`` is one with a known state, else the first
    forward run here (which draws as usual: the generators advance once).

    ``what``: the penalty, for the error raised where outputs came from elsewhere without their
    random state (a plain callable handing back the task's outputs, a :class:`SharedForward`
    without one) and a later forward draws random numbers. ``check``: called once, with the
    outputs of the first forward (the outputs' check of the call).
    """

    def __init__(self, fn: Callable[..., Tensor], what: str,
                 check: Callable[[Tensor], object] | None = None) -> None:
        self.fn, self.what, self._check = fn, what, check
        self.state = fn.state if isinstance(fn, SharedForward) else None
        self._reference_drew = self.state is not None
        self._later_checked = False

    @classmethod
    def of(cls, fn: Callable[..., Tensor], what: str,
           check: Callable[[Tensor], object] | None = None) -> Replaying:
        """``fn`` itself where it is a :class:`Replaying` already (one reference forward, one
        check), else ``Replaying(fn, what, check)``."""
        return fn if isinstance(fn, Replaying) else cls(fn, what, check)

    def __call__(self, *args: Tensor) -> Tensor:
        outputs = self._forward(*args)
        if self._check is not None:
            check, self._check = self._check, None
            check(outputs)
        return outputs

    def _forward(self, *args: Tensor) -> Tensor:
        if isinstance(self.fn, SharedForward) and self.fn.shares(args):
            if self.state is None:
                self.state = GeneratorState.capture(*args)
            return self.fn.outputs
        if self.state is None:
            self.state = GeneratorState.capture(*args)
            outputs = self.fn(*args)
            self._reference_drew = self.state.moved()
            return outputs
        with self.state.replayed():
            outputs = self.fn(*args)
            if not (self._reference_drew or self._later_checked):
                if self.state.moved():
                    raise GradientError(
                        f"{self.what} runs the model again at other points, and the model draws "
                        "random numbers (dropout or another random layer in training mode), but "
                        "the outputs at the points themselves were computed elsewhere without "
                        "the random state their forward began with: the other forwards could "
                        "not draw the same masks, and the result would measure the change of "
                        "mask. Pass the task's forward as gradreg.penalties.SharedForward("
                        "model, x, outputs, GeneratorState.capture(x)) with the state captured "
                        "before it (or SharedForward.run(model, x)), let the penalty run the "
                        "model itself, or put the random layers in eval mode.")
                self._later_checked = True
        return outputs
