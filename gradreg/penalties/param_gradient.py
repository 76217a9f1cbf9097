r"""A penalty of the parameter gradient's norm without a double backward (Zhao, Zhang & Hu 2022).

For a loss :math:`L(\theta)`, :math:`g = \nabla_\theta L`, and the penalty :math:`P(g)` of its
norm (``param_grad_norm``: :math:`P = \lVert g \rVert_2`), the chain rule gives
:math:`\nabla_\theta P = H v` with :math:`H = \nabla^2_\theta L` and :math:`v = \partial P /
\partial g` (for :math:`P = \lVert g\rVert_2`, :math:`v = g / \lVert g \rVert`). The
Hessian-vector product is a forward difference of gradients along :math:`\hat v = v/\lVert v
\rVert` with step :math:`r` (``step``):

.. math::

    H v \approx \lVert v \rVert\,
        \frac{\nabla L(\theta + r \hat v) - \nabla L(\theta)}{r},
    \qquad \text{error} = \tfrac{r}{2} \lVert v \rVert\, \nabla^3 L[\hat v, \hat v]
                        + O(u \lVert \nabla L \rVert \lVert v \rVert / r),

:math:`u` the unit roundoff. With weight :math:`\lambda`, :math:`P = \lVert g \rVert` and
:math:`\alpha = \lambda / r`, the step's gradient :math:`\nabla L + \lambda H \hat g` is the
paper's :math:`(1-\alpha)\nabla L(\theta) + \alpha \nabla L(\theta + r \hat g)`. It costs one
forward and backward at the shifted parameters, and the backward of :math:`g` at
:math:`\theta` (kept for the caller's backward of the task loss), no double backward: it runs on
fused attention kernels, on compiled models (``torch.compile``; their loss at
:math:`\theta` is computed again rather than shared, as their backward cannot retain its
graph) and on FSDP2-sharded modules inside :func:`gradreg.sharding.penalty_step` (it shifts and
differentiates the unsharded parameters the step holds: each rank's penalty is that of its own
batch's gradient, as for the exact form, and the step reduces the gradients as FSDP does).
Where :math:`L` is piecewise linear (ReLU), :math:`H` is zero almost everywhere and the
difference measures the kinks crossed within :math:`r`, as in the paper; the exact form
(``method="double_backward"``) gives :math:`H v` without them.

The parameters are shifted in place (their ``.data``, so that the autograd graph of the loss at
:math:`\theta` stays valid) and restored bitwise from a copy, also on an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gradreg.autograd import GradientError
from gradreg.penalties.chunks import with_gradients
from gradreg.penalties.compiled import runs_compiled
from gradreg.penalties.norms import per_sample_norm
from gradreg.penalties.precision import default_step, unit_roundoff
from gradreg.sharding import held_unsharded

if TYPE_CHECKING:
    from gradreg.penalties.methods import PenaltyCall, PenaltyFunctions

__all__ = ["LossAt", "ParameterFiniteDifference"]


class LossAt:
    """The loss as a function of the parameters' current values, for a penalty on
    ``points="parameters"`` by ``method="finite_difference"``: ``fn()`` computes it (called at
    the shifted parameters); ``loss``, where given, is its value already computed at the
    parameters as they are (the task loss: its forward is shared, not run again)::

        loss = F.cross_entropy(model(x), y)
        total = loss + penalty(LossAt(lambda: F.cross_entropy(model(x), y), loss), params)
    """

    def __init__(self, fn: Callable[[], Tensor], loss: Tensor | None = None) -> None:
        self.fn, self.loss = fn, loss

    def __call__(self) -> Tensor:
        return self.fn()


def _gradient(loss: Tensor, params: tuple[Tensor, ...], *, retain: bool) -> list[Tensor]:
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


class ParameterFiniteDifference:
    """The method (module docstring): value :math:`P(g)` exact, its parameter gradient
    :math:`H v` by a difference of gradients with step ``step`` (``None``: the
    :func:`~gradreg.penalties.precision.default_step` of the loss's arithmetic)."""

    def __init__(self, penalty: PenaltyFunctions, step: float | None, p: float,
                 squared: bool) -> None:
        self.penalty, self.step, self.p, self.squared = penalty, step, p, squared
        self._shares: bool | None = None  # whether the loss given at θ is used (first call)

    def __call__(self, call: PenaltyCall) -> Tensor:
        # FSDP2-sharded parameters: the unsharded ones penalty_step holds (their gradients are
        # reduced when the step ends)
        params = held_unsharded(call.inputs, "param_grad_norm by method='finite_difference'")
        loss = getattr(call.fn, "loss", None)
        if loss is not None and self._shares is None:
            # a compiled region's backward donates its buffers (no retain_graph): its loss is
            # computed again instead of shared
            self._shares = not runs_compiled(loss)
        loss = loss if loss is not None and self._shares else call.fn()
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            raise GradientError(
                "param_grad_norm by method='finite_difference' needs the loss as a callable "
                "returning a scalar (the mean loss) at the parameters' current values, e.g. "
                "penalty(LossAt(lambda: loss_fn(model(x), y)), params); got "
                f"{type(loss).__name__}{'' if not isinstance(loss, Tensor) else list(loss.shape)}")
        g = _gradient(loss, params, retain=loss is getattr(call.fn, "loss", None))
        leaves = [t.detach().requires_grad_() for t in g]
        with torch.enable_grad():
            value = self.penalty.of_norms(per_sample_norm(leaves, self.p, squared=self.squared,
                                                          per_sample=False))
            v = torch.autograd.grad(value, leaves, allow_unused=True)
        v = [torch.zeros_like(t) if d is None else d for t, d in zip(leaves, v, strict=True)]
        length = torch.sqrt(sum(d.square().sum() for d in v))
        step = self.step if self.step is not None else default_step(unit_roundoff(loss))
        shift = torch.where(length > 0, step / length, 0.0)  # no host sync
        saved = [p.detach().clone() for p in params]
        try:
            with torch.no_grad():
                for p, d in zip(params, v, strict=True):
                    p.data.add_(d * shift.to(d.dtype))
            shifted = _gradient(call.fn(), params, retain=False)
        finally:
            with torch.no_grad():
                for p, original in zip(params, saved, strict=True):
                    p.data.copy_(original)
        scale = length / step
        hvp = [(b - a) * scale.to(a.dtype) for a, b in zip(g, shifted, strict=True)]
        return with_gradients(value, list(params), hvp)
