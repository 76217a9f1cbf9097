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
from gradreg.penalties.state.randomness import SharedForward

__all__ = ["Configuration", "Method", "PenaltyCall", "PenaltyFunctions"]


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
class PenaltyCall:
    """One call of a penalty as a method sees it: the points (already subsampled), and either
    the per-sample ``outputs`` at them or a callable ``fn(*inputs, *fn_args)`` that computes
    them; ``loss_scale`` as in :meth:`GradientPenalty.forward
    <gradreg.penalties.GradientPenalty.forward>`."""

    inputs: tuple[Tensor, ...]
    outputs: Tensor | None = None
    fn: Callable[..., Tensor] | None = None
    fn_args: tuple[Tensor, ...] = ()
    loss_scale: LossScale = None

    def evaluate(self) -> Tensor:
        """The per-sample outputs at the points: those given, or the callable's."""
        return self.outputs if self.fn is None else self.fn(*self.inputs, *self.fn_args)

    def of_points(self, *points: Tensor) -> Tensor:
        """The callable at other points, with the same further arguments."""
        return self.fn(*points, *self.fn_args)

    def forward(self) -> Callable[..., Tensor]:
        """The callable as a function of the points alone (:meth:`of_points`); a
        :class:`~gradreg.penalties.state.randomness.SharedForward` stays one, so the methods that
        run
        the model again replay the random state of the task's forward."""
        if isinstance(self.fn, SharedForward):
            return self.fn.with_args(self.fn_args)
        return self.of_points


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


#: A method: one call in, the unweighted penalty out (carrying the parameter gradient).
Method = Callable[[PenaltyCall], Tensor]
