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
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gradreg.autograd import GradientError, gradient
from gradreg.graph import graph_node_names
from gradreg.penalties.formulas.norms import per_sample_norm
from gradreg.penalties.guards.checks import check_per_sample, check_per_sample_losses
from gradreg.penalties.guards.compiled import runs_compiled
from gradreg.penalties.guards.coupling import check_independent_samples, probe_independent_samples
from gradreg.penalties.guards.precision import default_step, unit_roundoff
from gradreg.penalties.state.call import PenaltyCall, PenaltyFunctions
from gradreg.penalties.state.randomness import Replaying

if TYPE_CHECKING:
    from gradreg.penalties.config import PenaltyConfig

__all__ = ["PIECEWISE_LINEAR", "FiniteDifference", "check_smooth", "finite_difference"]

#: Backward-node name prefixes of the ops whose derivative jumps (activations, max pooling, clamp,
#: abs, max/min): a finite difference across a kink has an O(1) error.
PIECEWISE_LINEAR = (
    "Relu", "LeakyRelu", "RreluWithNoise", "PreluKernel", "Hardtanh", "Threshold", "Hardswish",
    "Hardsigmoid", "Hardshrink", "Softshrink", "MaxPool", "AdaptiveMaxPool", "Clamp", "Abs",
    "Maximum", "Minimum", "Max", "Min", "Amax", "Amin",
)

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
    the (cheap, first-order) gradient of ``penalty_of_grads`` at the detached :math:`g`. Cost: the
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
    forward = Replaying(fn, "method='finite_difference'")
    outputs = forward(*inputs)
    check_per_sample(outputs, inputs)
    if losses:  # a penalty of per-sample losses (of="loss"): one value per sample
        check_per_sample_losses(outputs)
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
    shifted = tuple(x.detach() + _broadcast(h, v) * v
                    for x, v in zip(inputs, directions, strict=True))
    delta = (forward(*shifted) - outputs).reshape(len(norms), -1).sum(1)
    surrogate = (delta * torch.where(moving, norms / step, 0.0)).sum()
    return value.detach() + (surrogate - surrogate.detach())


def check_smooth(outputs: Tensor) -> None:
    """Raise where the graph of ``outputs`` holds an op whose derivative jumps
    (:data:`PIECEWISE_LINEAR`: ``nn.ReLU`` and ``F.relu`` alike, max pooling, clamp, abs...):
    there a finite difference is off by O(1), and a smaller step does not help."""
    ops = sorted({name.split("Backward")[0] for name in graph_node_names([outputs])
                  if name.startswith(PIECEWISE_LINEAR)})
    if ops:
        raise GradientError(
            f"method='finite_difference' on a piecewise-linear model ({', '.join(ops)} in its "
            "graph): where a unit changes sign between x and the shifted point the estimate is "
            "off by O(1), and a smaller step does not help. Use method='double_backward', or a "
            "smooth activation (softplus, elu, tanh, gelu, silu)."
        )


class FiniteDifference:
    """Exact value, parameter gradient by a finite difference
    (:func:`~gradreg.penalties.methods.finite_difference.finite_difference`); the model is checked
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
