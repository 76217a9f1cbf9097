r"""The penalty's parameter gradient by a finite difference of first derivatives (no double
backward), and the check of the models it is refused on (kinks); coupled samples are refused by
:func:`~gradreg.penalties.guards.coupling.check_independent_samples`, and the forward at the shifted
points draws the random numbers of the forward at the points
(:class:`~gradreg.penalties.state.randomness.Replaying`).

Notation as in :mod:`gradreg.penalties.methods`: per-sample outputs :math:`f_i`, points
:math:`x_i`, input gradients :math:`g_i`, the unweighted penalty :math:`P(g)`, parameters
:math:`\theta`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from gradreg.autograd import GradientError, gradient
from gradreg.penalties.call import Configuration, Method, PenaltyCall, PenaltyFunctions
from gradreg.penalties.formulas.norms import per_sample_norm
from gradreg.penalties.guards.checks import check_outputs
from gradreg.penalties.guards.compiled import runs_compiled
from gradreg.penalties.guards.coupling import check_independent_samples, probe_independent_samples
from gradreg.penalties.guards.options import Option, check_flag, check_step, require
from gradreg.penalties.guards.precision import default_step, unit_roundoff
from gradreg.penalties.guards.smoothness import PIECEWISE_LINEAR, piecewise_linear_ops
from gradreg.penalties.methods.param_gradient import ParameterFiniteDifference
from gradreg.penalties.state.randomness import Replaying

__all__ = ["PIECEWISE_LINEAR", "SHIFTS", "FiniteDifference", "FiniteDifferenceMethod",
           "ParameterShift", "check_smooth", "finite_difference"]

PenaltyOfGradients = Callable[[tuple[Tensor, ...]], Tensor]
PerSampleFunction = Callable[..., Tensor]


def _broadcast(per_sample: Tensor, like: Tensor) -> Tensor:
    return per_sample.view((-1,) + (1,) * (like.ndim - 1))


def finite_difference(
    fn: PerSampleFunction,
    inputs: tuple[Tensor, ...],
    penalty_of_grads: PenaltyOfGradients,
    *,
    step: float | None = None,
    check: bool = True,
    losses: bool = False,
) -> Tensor:
    r"""Exact :math:`P`, whose parameter gradient is a forward difference (no double backward).

    With :math:`v_i = \partial P/\partial g_i` and a per-sample step
    :math:`h_i = \text{step}/\lVert v_i \rVert` (each sample moves by ``step`` in input space),

    .. math::

        S = \sum_i \frac{f_i(x_i + h_i v_i) - f_i(x_i)}{h_i}, \qquad
        \nabla_\theta S = \sum_i H_{\theta x_i} v_i + O(\text{step})
                        = \nabla_\theta P + O(\text{step}).

    Any target, power, norm order, sidedness and reduction enter only through :math:`v`, which is
    the (cheap, first-order) gradient of ``penalty_of_grads`` at the detached :math:`g`. Points
    computed by a graph (a model's embeddings) are shifted with it, so that
    :math:`\nabla_{x_i} S = (\nabla f_i(x_i + h_i v_i) - \nabla f_i(x_i))/h_i = H_{x_i x_i} v_i +
    O(\text{step}) = \nabla_{x_i} P + O(\text{step})` reaches what computed them (the embedding
    matrix); a leaf point's own gradient is not meaningful. Cost: the
    forward at :math:`x`, one backward to the inputs only, a forward and a backward at the shifted
    points; the backward at :math:`x` is shared with whatever else uses ``fn``'s graph (on a
    ``torch.compile``'d model the gradient at :math:`x` runs a forward of its own: a compiled
    graph takes one backward, :func:`~gradreg.penalties.guards.compiled.runs_compiled`). To share
    the forward at :math:`x` with the task loss too, pass the task's forward as ``fn``:
    ``SharedForward.run(per_sample_loss, x, y)`` (:class:`~gradreg.penalties.state.randomness
    .SharedForward`: its outputs at :math:`x`, the loss from them, and the random state that
    forward began with, which the shifted forward replays; a plain
    ``lambda q: losses if q is x else ...`` also works for a model that draws no random numbers).
    ``losses``: ``fn`` returns per-sample losses (a penalty with ``of="loss"``), so outputs with
    more than one value per sample (logits) are refused.

    Error: relative :math:`O(\text{step})` (third derivatives) plus :math:`O(u/\text{step})`
    (rounding, :math:`u` the unit roundoff of the arithmetic as it ran, :func:`unit_roundoff`);
    :func:`default_step` balances the two for float64, float32 and TF32 (the default of float32
    convolutions on Ampere and newer GPUs, whose error is the largest); the errors measured with
    it are in ``docs/benchmarks.md``. For the float32 error on such a GPU, turn TF32 off
    (``torch.backends.cudnn.allow_tf32 = False``); for an exact gradient use double backward.
    On piecewise-linear models the parameter gradient jumps where a unit changes sign between
    :math:`x` and :math:`x + hv`, which happens with probability :math:`O(h)` and costs
    :math:`O(1/h)`: an :math:`O(1)` error that a smaller step does not remove: with ``check``
    the graph of the outputs at :math:`x` is searched and such models are refused
    (:func:`check_smooth`). Samples must not interact: with ``check`` a model whose samples are
    coupled (BatchNorm in training mode, a minibatch standard deviation) is refused
    (:func:`~gradreg.penalties.guards.coupling.check_independent_samples`). The forward at the
    shifted points replays the random state of the one at :math:`x` (the same dropout mask; ``fn``
    may be a :class:`~gradreg.penalties.state.randomness.SharedForward` carrying the task's state),
    so
    :math:`S` differences one function.
    """
    forward = Replaying.of(fn, "method='finite_difference'",
                           partial(check_outputs, inputs=inputs, losses=losses))
    outputs = forward(*inputs)
    compiled = runs_compiled(outputs)  # one backward per compiled graph: forwards of their own
    if check:
        check_smooth(outputs)
        if compiled:
            probe_independent_samples(fn, inputs, "method='finite_difference'")
        else:
            check_independent_samples(outputs, inputs, "method='finite_difference'")
    at = tuple(x.detach().requires_grad_() for x in inputs) if compiled else inputs
    grads = gradient(forward(*at) if compiled else outputs, at,
                     grad_outputs=torch.ones_like(outputs), create_graph=False,
                     retain_graph=not compiled)
    with torch.enable_grad():
        leaves = tuple(g.detach().requires_grad_() for g in grads)
        value = penalty_of_grads(leaves)
        directions = torch.autograd.grad(value, leaves)
    step = default_step(unit_roundoff(outputs)) if step is None else step
    norms = per_sample_norm(directions)
    moving = norms > 0
    h = torch.where(moving, step / torch.where(moving, norms, 1.0), 0.0)
    # points computed by a graph (embeddings) keep it: S's gradient to them is then the
    # difference of input gradients, H_xx v + O(step) = ∂P/∂x, which reaches what computed them
    shifted = tuple((x if x.grad_fn is not None else x.detach()) + _broadcast(h, v) * v
                    for x, v in zip(inputs, directions, strict=True))
    delta = (forward(*shifted) - outputs).reshape(len(norms), -1).sum(1)
    surrogate = (delta * torch.where(moving, norms / step, 0.0)).sum()
    return value.detach() + (surrogate - surrogate.detach())


def check_smooth(outputs: Tensor) -> None:
    """Raise where the graph of ``outputs`` holds an op whose derivative jumps
    (:data:`PIECEWISE_LINEAR`: ``nn.ReLU`` and ``F.relu`` alike, max pooling, clamp, abs...):
    there a finite difference is off by O(1), and a smaller step does not help."""
    ops = piecewise_linear_ops(outputs)
    if ops:
        raise GradientError(
            f"method='finite_difference' on a piecewise-linear model ({', '.join(ops)} in its "
            "graph): where a unit changes sign between x and the shifted point the estimate is "
            "off by O(1), and a smaller step does not help. Use method='double_backward', or a "
            "smooth activation (softplus, elu, tanh, gelu, silu)."
        )


def _check_difference(name: str, config: Configuration) -> None:
    """Refuse what a difference of first derivatives does not compute: another projection or
    order, an ``"ema"`` target, activations as points."""
    norm = config.norm
    require(norm.projection == "sum" and norm.order == 1 and norm.numeric_target
            and config.points != "activations",
            f"method={name!r} supports projection='sum', order=1, a numeric target and "
            "per-sample points other than 'activations' (and points='parameters' with "
            "method='finite_difference'); use method='double_backward'")


@dataclass(frozen=True, eq=False)
class FiniteDifference(Option):
    """``method="finite_difference"``: the exact value, its parameter gradient by the forward
    difference of :func:`finite_difference` over a shift of length ``step`` in input space
    (``None``: :func:`~gradreg.penalties.guards.precision.default_step` of the arithmetic); for
    ``points="parameters"`` its form :class:`ParameterShift`.

    Examples:
        >>> from gradreg.penalties.methods import FiniteDifference
        >>> FiniteDifference(step=1e-3).step
        0.001
        >>> FiniteDifference(step=-1.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: step (the estimate's step size) must be a number > 0 ... got -1.0.
    """

    name = "finite_difference"

    step: float | None = None

    def __post_init__(self) -> None:
        check_step(self.step)

    @classmethod
    def form(cls, flat: dict[str, Any]) -> type[Option]:
        """:class:`ParameterShift` for ``points="parameters"``, else this class."""
        return ParameterShift if flat["points"] == "parameters" else cls

    @classmethod
    def step_field(cls, flat: dict[str, Any]) -> str | None:
        return "step"

    def check(self, config: Configuration) -> None:
        """Refuse what a difference of input gradients does not compute (and the parameters,
        which :class:`ParameterShift` shifts)."""
        _check_difference(self.name, config)
        require(config.points != "parameters",
                "points='parameters' by finite difference shifts the parameters: pass "
                "method=ParameterShift(shift, radius | scale, adaptive) (the flat options do)")

    def build(self, config: Configuration, penalty: PenaltyFunctions) -> Method:
        return FiniteDifferenceMethod(penalty, self.step)


class FiniteDifferenceMethod:
    """Exact value, parameter gradient by a finite difference (:func:`finite_difference`); the
    model is checked (smooth, samples independent) on the first call. The forward at the
    shifted points replays the random state of the one at the points
    (:meth:`PenaltyCall.forward`)."""

    def __init__(self, penalty: PenaltyFunctions, step: float | None) -> None:
        self.penalty, self.step = penalty, step
        self._checked = False

    def __call__(self, call: PenaltyCall) -> Tensor:
        value = finite_difference(call.forward("method='finite_difference'"), call.inputs,
                                  self.penalty.of_gradients, step=self.step,
                                  check=not self._checked)
        self._checked = True  # only once the check has passed
        return value


#: The shift rules of :class:`ParameterShift`: a fixed length ``radius`` (``"normalized"``), or
#: ``scale`` times :math:`v` (``"gradient"``).
SHIFTS = ("normalized", "gradient")


@dataclass(frozen=True, eq=False)
class ParameterShift(Option):
    r"""``method="finite_difference"`` for ``points="parameters"`` (module docstring of
    :mod:`~gradreg.penalties.methods.param_gradient`): the parameters shifted along
    :math:`v = \partial P/\partial g` by the length ``radius`` (``shift="normalized"``:
    :math:`\theta + r\hat v`, GNP, SAM) or by ``scale`` times :math:`v` (``shift="gradient"``:
    :math:`\theta + \epsilon v`, GR, ASAM); ``adaptive``: the norm of
    :math:`\lvert\theta\rvert \odot g` (ASAM). ``None``: the
    :func:`~gradreg.penalties.guards.precision.default_step` of the loss's arithmetic for a
    parameter shift (:data:`~gradreg.penalties.guards.precision.PARAMETER_STEPS`; times
    :data:`~gradreg.penalties.methods.param_gradient.GRADIENT_SHIFT_FACTOR` for ``"gradient"``).
    The flat alias ``step`` sets the one the shift rule takes.

    Examples:
        >>> from gradreg.penalties.methods import ParameterShift
        >>> ParameterShift("gradient", scale=0.5, adaptive=True).name
        'finite_difference'
        >>> ParameterShift(shift="sideways")
        Traceback (most recent call last):
        ...
        ValueError: shift must be one of ('normalized', 'gradient'), got 'sideways'.
        >>> ParameterShift(scale=0.1)
        Traceback (most recent call last):
        ...
        ValueError: scale is the factor of shift='gradient': pass shift='gradient' (or radius).
    """

    name = "finite_difference"

    shift: str = "normalized"
    radius: float | None = None
    scale: float | None = None
    adaptive: bool = False

    def __post_init__(self) -> None:
        require(self.shift in SHIFTS, f"shift must be one of {SHIFTS}, got {self.shift!r}")
        check_step(self.radius, "radius")
        check_step(self.scale, "scale")
        require(self.scale is None or self.shift == "gradient",
                "scale is the factor of shift='gradient': pass shift='gradient' (or radius)")
        require(self.radius is None or self.shift == "normalized",
                "radius is the length of shift='normalized': pass scale with shift='gradient'")
        check_flag("adaptive", self.adaptive)

    @classmethod
    def step_field(cls, flat: dict[str, Any]) -> str | None:
        return "scale" if flat["shift"] == "gradient" else "radius"

    @property
    def length(self) -> float | None:
        """The shift's ``radius`` or ``scale``, the one its rule takes (``None``: default)."""
        return self.scale if self.shift == "gradient" else self.radius

    def check(self, config: Configuration) -> None:
        _check_difference(self.name, config)
        require(config.points == "parameters",
                f"ParameterShift shifts the parameters; it does nothing with "
                f"points={config.points!r}: pass points='parameters'")

    def build(self, config: Configuration, penalty: PenaltyFunctions) -> Method:
        return ParameterFiniteDifference(penalty, config, step=self.length, shift=self.shift,
                                         adaptive=self.adaptive)
