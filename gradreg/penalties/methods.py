r"""How a penalty's parameter gradient is computed (``double_backward``, ``finite_difference``,
``perturbation``), and the cost levers that keep the method (``subsample``, lazy ``every``).

Notation: per-sample outputs :math:`f_i`, points :math:`x_i`, input gradients
:math:`g_i = \nabla_{x_i} \sum_j f_j`, the unweighted penalty :math:`P(g)` (a function of the
gradients only, built by :class:`~gradreg.penalties.GradientPenalty`), parameters :math:`\theta`.
By the chain rule, with :math:`v_i = \partial P / \partial g_i` held fixed,

.. math::

    \nabla_\theta P = \sum_i H_{\theta x_i} v_i
                    = \nabla_\theta \sum_i \langle \nabla_{x_i} f_i, v_i \rangle ,

a mixed second derivative. ``double_backward`` gets it exactly by differentiating the graph of
:math:`g` (reverse over reverse); ``finite_difference`` returns the exact value
of :math:`P` plus a zero-valued surrogate :math:`S - \operatorname{detach}(S)` whose parameter
gradient is the estimate, so ``(task + penalty).backward()`` works unchanged. Only parameter
gradients are estimated; the gradient the surrogate sends to the points themselves is not
meaningful. ``perturbation`` (squared norms with target 0 only) replaces :math:`P` itself by an
estimate from perturbed forwards (:mod:`~gradreg.penalties.perturbation`), differentiated by an
ordinary first-order backward: value and parameter gradient are :math:`P`'s in expectation.

| method            | work on top of the task step           | error of the parameter gradient   |
|-------------------|----------------------------------------|-----------------------------------|
| double_backward   | input backward with graph + its        | exact                             |
|                   | backward (about 2x a plain step)       |                                   |
| finite_difference | input backward, forward + backward at  | O(step) + O(u/step) when smooth;  |
|                   | shifted points (about 2.3x in FLOPs)   | O(1) piecewise-linear (refused)   |
| perturbation      | a forward at x + σε, first-order       | an estimate: sampling noise       |
|                   | backward only (squared norms, target 0)| (rel. std √2 per probe), O(σ²)    |

``chunks`` keeps double backward (exact) and trades kernel size and two parameter-sized buffers
for the memory of the penalty's graph: it is built and differentiated one micro-batch at a time
(:func:`~gradreg.penalties.chunks.in_chunks`).

A method is chosen once, when the penalty is built (:func:`choose`), as a callable from one
:class:`PenaltyCall` to the unweighted penalty; :data:`BUILDERS` holds one builder per name.
Measured ratios are in ``docs/benchmarks.md`` (``scripts/benchmark.py``).

The helpers of the methods live in their own modules and are importable from here too:
:mod:`~gradreg.penalties.precision` (the unit roundoff and the finite-difference step),
:mod:`~gradreg.penalties.finite_difference` and
:mod:`~gradreg.penalties.chunks` (micro-batches, subsample, the gradient surrogate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from gradreg.attention import differentiable_attention, explain_fused_attention
from gradreg.autograd import GradientError
from gradreg.penalties.chunks import in_chunks, subsample, with_gradients
from gradreg.penalties.compiled import check_not_compiled
from gradreg.penalties.config import METHODS
from gradreg.penalties.coupling import check_independent_samples
from gradreg.penalties.finite_difference import PIECEWISE_LINEAR, check_smooth, finite_difference
from gradreg.penalties.lazy import lazy_optimizer_kwargs
from gradreg.penalties.loss_scale import LossScale
from gradreg.penalties.param_gradient import ParameterFiniteDifference
from gradreg.penalties.perturbation import DEFAULT_COUNT, DEFAULT_STEP, perturbation_sq_norms
from gradreg.penalties.precision import (
    STEPS,
    TF32_ROUNDOFF,
    cuda_float32_roundoff,
    default_step,
    unit_roundoff,
)
from gradreg.penalties.randomness import GeneratorState, SharedForward

if TYPE_CHECKING:
    from gradreg.penalties.config import PenaltyConfig

__all__ = [
    "BUILDERS",
    "METHODS",
    "PIECEWISE_LINEAR",
    "STEPS",
    "TF32_ROUNDOFF",
    "DoubleBackward",
    "FiniteDifference",
    "InChunks",
    "Method",
    "PenaltyCall",
    "PenaltyFunctions",
    "Perturbation",
    "check_independent_samples",
    "check_smooth",
    "choose",
    "cuda_float32_roundoff",
    "default_step",
    "finite_difference",
    "in_chunks",
    "lazy_optimizer_kwargs",
    "subsample",
    "unit_roundoff",
    "with_gradients",
]



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
        :class:`~gradreg.penalties.randomness.SharedForward` stays one, so the methods that run
        the model again replay the random state of the task's forward."""
        if isinstance(self.fn, SharedForward):
            return self.fn.with_args(self.fn_args)
        return self.of_points


@dataclass(frozen=True)
class PenaltyFunctions:
    """What a method is given of the penalty: ``exact(outputs, points, loss_scale)``, the
    unweighted penalty of per-sample outputs built for double backward (``create_graph=True``;
    an :class:`~gradreg.penalties.exact.ExactPenalty`, which runs its own first-call checks),
    ``of_gradients(grads)``, the unweighted penalty as a function of the per-sample input
    gradients alone (differentiable in them), and ``of_norms(norms)``, as a function of the
    per-sample norms (squared where the configuration's ``squared`` says so)."""

    exact: Callable[[Tensor, tuple[Tensor, ...], LossScale], Tensor]
    of_gradients: Callable[[tuple[Tensor, ...]], Tensor]
    of_norms: Callable[[Tensor], Tensor]


#: A method: one call in, the unweighted penalty out (carrying the parameter gradient).
Method = Callable[[PenaltyCall], Tensor]


class DoubleBackward:
    """Exact: the penalty of the outputs (given, or the callable's), by double backward. The
    callable runs inside :func:`~gradreg.attention.differentiable_attention` (fused attention
    kernels have no double backward)."""

    def __init__(self, penalty: PenaltyFunctions) -> None:
        self.penalty = penalty
        self._checked = False

    def __call__(self, call: PenaltyCall) -> Tensor:
        with differentiable_attention():
            outputs = call.evaluate()
        if not self._checked:  # a torch.compile'd model: refused on the first call
            check_not_compiled(outputs)
            self._checked = True
        try:
            return self.penalty.exact(outputs, call.inputs, call.loss_scale)
        except GradientError as err:  # the outputs computed outside differentiable attention
            explained = explain_fused_attention(err)
            if explained is err:
                raise
            raise explained from err


class InChunks:
    """Exact, ``chunks`` micro-batches at a time (:func:`~gradreg.penalties.chunks.in_chunks`).
    On the first call every micro-batch holds at least two samples (split into fewer pieces
    where the batch is small), so that the probe of coupled samples
    (:func:`~gradreg.penalties.coupling.check_independent_samples`, run on the first
    micro-batch's graph) can see one sample's outputs move with another's input."""

    def __init__(self, penalty: PenaltyFunctions, chunks: int, *, mean: bool) -> None:
        self.penalty, self.chunks, self.mean = penalty, chunks, mean
        self._probed = False

    def __call__(self, call: PenaltyCall) -> Tensor:
        batch = call.inputs[0].shape[0] if call.inputs[0].ndim else 1
        chunks = self.chunks if self._probed else max(1, min(self.chunks, batch // 2))
        watch = chunks > 1  # the first micro-batch's forward, when there are several

        def penalty_of_points(xs: tuple[Tensor, ...], args: tuple[Tensor, ...]) -> Tensor:
            nonlocal watch
            state, watch = GeneratorState.capture(*xs) if watch else None, False
            with differentiable_attention():
                outputs = call.fn(*xs, *args)
            check_not_compiled(outputs)
            if state is not None and state.moved():
                raise GradientError(
                    f"chunks={self.chunks} runs the model one micro-batch at a time, but the "
                    "model draws random numbers (dropout or another random layer in training "
                    "mode): a micro-batch's forward draws other masks for its samples than the "
                    "batch's forward, so the chunked penalty would not be that of one forward. "
                    "Put the random layers in eval mode for the penalty, or use chunks=1 (the "
                    "exact double backward of one forward).")
            return self.penalty.exact(outputs, xs, call.loss_scale)

        value = in_chunks(penalty_of_points, call.inputs, chunks, args=call.fn_args,
                          mean=self.mean, loss_scale=call.loss_scale)
        self._probed = True
        return value


class FiniteDifference:
    """Exact value, parameter gradient by a finite difference
    (:func:`~gradreg.penalties.finite_difference.finite_difference`); the model is checked
    (smooth, samples independent) on the first call. The forward at the shifted points replays
    the random state of the one at the points (:meth:`PenaltyCall.forward`)."""

    def __init__(self, penalty: PenaltyFunctions, config: PenaltyConfig) -> None:
        self.penalty, self.step, self.losses = penalty, config.step, config.of == "loss"
        self._checked = False

    def __call__(self, call: PenaltyCall) -> Tensor:
        value = finite_difference(call.forward(), call.inputs, self.penalty.of_gradients,
                                  step=self.step, check=not self._checked, losses=self.losses)
        self._checked = True  # only once the check has passed
        return value


class Perturbation:
    """The squared norms estimated from perturbed forwards
    (:func:`~gradreg.penalties.perturbation.perturbation_sq_norms`), no double backward; the
    forward at the points themselves is the callable's (a
    :class:`~gradreg.penalties.randomness.SharedForward` hands back the task's outputs there and
    the random state their forward began with, which the perturbed forwards replay). Samples
    are checked independent on the first call (coupled samples are refused)."""

    def __init__(self, penalty: PenaltyFunctions, config: PenaltyConfig) -> None:
        self.penalty = penalty
        self.options = {
            "step": DEFAULT_STEP if config.step is None else config.step,
            "central": config.central,
            "count": DEFAULT_COUNT if config.count is None else config.count,
            "losses": config.of == "loss"}
        self._checked = False

    def __call__(self, call: PenaltyCall) -> Tensor:
        sq = perturbation_sq_norms(call.forward(), call.inputs, check_samples=not self._checked,
                                   **self.options)
        self._checked = True  # only once the check has passed
        return self.penalty.of_norms(sq)


def _double_backward(config: PenaltyConfig, penalty: PenaltyFunctions) -> Method:
    if config.chunks > 1:
        return InChunks(penalty, config.chunks, mean=config.reduction == "mean")
    return DoubleBackward(penalty)


#: How each method is built from the configuration and the penalty's functions.
BUILDERS: dict[str, Callable[[PenaltyConfig, PenaltyFunctions], Method]] = {
    "double_backward": _double_backward,
    "finite_difference": lambda config, penalty: (
        ParameterFiniteDifference(penalty, config) if config.points == "parameters"
        else FiniteDifference(penalty, config)),
    "perturbation": lambda config, penalty: Perturbation(penalty, config),
}



def choose(config: PenaltyConfig, penalty: PenaltyFunctions) -> Method:
    """The method ``config.method`` (with ``config.chunks``) for ``penalty``, built once."""
    return BUILDERS[config.method](config, penalty)
