r"""One call of a penalty as a method sees it (:class:`PenaltyCall`), what a method is given of
the penalty (:class:`PenaltyFunctions`), and the type of a method (:data:`Method`): the protocol
between :class:`~gradreg.penalties.GradientPenalty` and the methods and kinds, which hold
nothing else of each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from gradreg.penalties.state.loss_scale import LossScale
from gradreg.penalties.state.randomness import Replaying, SharedForward

__all__ = ["Configuration", "Method", "PenaltyCall", "PenaltyFunctions", "TaskGradient"]


class Configuration(Protocol):
    """What the methods and the kinds read of a penalty's configuration (a
    :class:`~gradreg.penalties.config.PenaltyConfig`, which is built from them): its norm
    (:class:`~gradreg.penalties.formulas.options.Norm`), method and kind objects, and the
    options of the penalty as a whole."""

    norm: Any
    method: Any
    kind: Any
    points: str
    of: str
    gain: float
    subsample: float

    @property
    def per_sample(self) -> bool: ...


@dataclass(frozen=True)
class TaskGradient:
    r"""A request to a method that takes the task loss's gradient :math:`g` on its way (the
    two-pass finite difference of the parameter gradient,
    :func:`~gradreg.penalties.two_pass.penalized_loss`): take :math:`g` for the caller too
    (the loss's graph freed unless ``retain_graph``) and return, beside the penalty's value,
    either :math:`g + c\,Hv` (``factor`` :math:`c`: the penalty's
    :attr:`~gradreg.penalties.GradientPenalty.factor`; the value then carries no gradient) or,
    with ``split``, :math:`g` alone (the value carrying :math:`Hv`, weighted with it)."""

    factor: float
    retain_graph: bool = False
    split: bool = False


@dataclass(frozen=True)
class PenaltyCall:
    """One call of a penalty as a method sees it: the points (already subsampled), and either
    the per-sample ``outputs`` at them or a callable ``fn(*inputs, *fn_args)`` that computes
    them; ``loss_scale`` as in :meth:`GradientPenalty.forward
    <gradreg.penalties.GradientPenalty.forward>`; ``check(outputs)``: the check of the outputs
    at the points (:func:`~gradreg.penalties.guards.checks.check_outputs` with the points bound:
    real, one row per sample, one loss per sample for a penalty of losses), the one check of the
    outputs of a call, which every method runs once on them (through :meth:`evaluate`,
    :meth:`forward`, or itself on given outputs; ``check(outputs, inputs=part)`` for the
    outputs of a part of the points). ``task``: where given (:class:`TaskGradient`), the method
    returns ``(value, task gradient)`` (:data:`Method`)."""

    inputs: tuple[Tensor, ...]
    check: Callable[..., None]
    outputs: Tensor | None = None
    fn: Callable[..., Tensor] | None = None
    fn_args: tuple[Tensor, ...] = ()
    loss_scale: LossScale = None
    task: TaskGradient | None = None

    def evaluate(self) -> Tensor:
        """The per-sample outputs at the points, checked: those given, or the callable's."""
        outputs = self.outputs if self.fn is None else self.fn(*self.inputs, *self.fn_args)
        self.check(outputs)
        return outputs

    def of_points(self, *points: Tensor) -> Tensor:
        """The callable at other points, with the same further arguments."""
        return self.fn(*points, *self.fn_args)

    def forward(self, what: str, *, checked: bool = True) -> Replaying:
        """The callable as a function of the points alone, for a method that runs it more than
        once: every forward draws the random numbers of the first (a
        :class:`~gradreg.penalties.state.randomness.SharedForward` hands back the task's outputs
        at the points and the random state its forward began with), and the first forward's
        outputs are checked (:attr:`check`; not with ``checked=False``, for outputs that are
        not one tensor). ``what``: the method, for its errors."""
        fn = (self.fn.with_args(self.fn_args) if isinstance(self.fn, SharedForward)
              else self.of_points)
        return Replaying(fn, what, self.check if checked else None)


@dataclass(frozen=True)
class PenaltyFunctions:
    """What a method is given of the penalty: ``exact(outputs, points, loss_scale)``, the
    unweighted penalty of per-sample outputs built for double backward (``create_graph=True``;
    an :class:`~gradreg.penalties.methods.double_backward.ExactPenalty`, which runs its own
    first-call checks), ``of_gradients(grads)``, the unweighted penalty as a function of the
    per-sample input gradients alone (differentiable in them), and ``of_norms(norms)``, as a
    function of the
    per-sample norms (squared where the configuration's ``squared`` says so)."""

    exact: Callable[[Tensor, tuple[Tensor, ...], LossScale], Tensor]
    of_gradients: Callable[[tuple[Tensor, ...]], Tensor]
    of_norms: Callable[[Tensor], Tensor]


#: The task loss's gradient a method hands back for a :class:`TaskGradient` request, one entry
#: per parameter (None for a parameter the loss does not use).
Gradients = list[Tensor | None]

#: A method: one call in, the unweighted penalty out (carrying the parameter gradient); for a
#: call with a :attr:`~PenaltyCall.task` request, a method that takes the task's gradient returns
#: ``(value, gradients)`` instead (one that does not returns the value alone, which then carries
#: its gradient as usual).
Method = Callable[[PenaltyCall], Tensor | tuple[Tensor, Gradients]]
