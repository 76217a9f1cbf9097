r"""A task loss and a parameter-gradient penalty at the two-pass cost (Zhao, Zhang & Hu 2022).

For ``param_grad_norm`` by ``method="finite_difference"`` (and :func:`~gradreg.penalties.sam`)
the step's gradient is the paper's

.. math::

    \nabla L(\theta) + c\,\lVert v \rVert\,
        \frac{\nabla L(\theta + r \hat v) - \nabla L(\theta)}{r}
    \;=\; (1-\alpha)\,\nabla L(\theta) + \alpha\, \nabla L(\theta + r \hat g)
    \quad (P = \lVert g \rVert,\ \alpha = c / r),

:math:`c` the penalty's weight (times ``every`` and ``gain``), :math:`v = \partial P/\partial g`.
It needs two forward and backward passes: one at :math:`\theta` for :math:`g = \nabla L(\theta)`,
one at the shifted parameters. Written as ``loss + penalty(LossAt(fn, loss), params)``, the
penalty takes :math:`g` keeping the loss's graph and the caller's backward takes it again (three
passes). :func:`penalized_loss` hands the :math:`g` the penalty took to the caller instead: the
task term it returns carries the whole gradient (:class:`Carried`: one autograd node whose
backward hands each parameter its precomputed gradient times the incoming scale), the loss's
graph is freed after the first pass, and one ``backward`` of the sum fills ``.grad`` as the
hand-written recipe does, so gradient accumulation (a backward per micro-batch of the scaled
loss), clipping, ``GradScaler`` and Lightning's automatic
optimization apply unchanged. Other penalties keep the plain form (double backward cannot share
the first pass: it differentiates the loss's graph twice).

    >>> import torch, torch.nn.functional as F
    >>> from gradreg.penalties import param_grad_norm
    >>> from gradreg.penalties.methods.param_gradient import LossAt
    >>> from gradreg.penalties.two_pass import penalized_loss
    >>> torch.manual_seed(0) and None
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    >>> gnp = param_grad_norm(0.01, method="finite_difference")
    >>> at = LossAt.run(lambda: F.cross_entropy(model(x), y), x)
    >>> task, penalty = penalized_loss(gnp, at, list(model.parameters()))
    >>> (task + penalty).backward()  # .grad = (1 - α) ∇L(θ) + α ∇L(θ + r ĝ)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from gradreg.autograd import GradientError
from gradreg.penalties.call import TaskGradient
from gradreg.penalties.mechanism import GradientPenalty
from gradreg.penalties.methods.param_gradient import LossAt, in_dtypes

__all__ = ["Carried", "add_to_grad", "penalized_backward", "penalized_loss"]


class Carried(torch.autograd.Function):
    """``Carried.apply(value, gradients, hand_over, *params)``: ``value`` (detached), whose
    backward sends ``gradients[j] * grad_output`` to ``params[j]``; one node for all the
    parameters (a sum of products would be three per parameter), first order only. With
    ``hand_over`` the gradients are scaled in place and handed over (``.grad`` takes their
    memory) and a second backward is refused; without, they are kept (a graph retained for
    several backwards: a per-term gradient split)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, value: Tensor,
                gradients: list[Tensor], hand_over: bool, *params: Tensor) -> Tensor:
        ctx.gradients, ctx.hand_over = gradients, hand_over
        return value.detach().clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 scale: Tensor) -> tuple[Tensor | None, ...]:
        gradients = ctx.gradients
        if gradients is None:
            raise GradientError("the task term of penalized_loss handed its gradient over in its "
                                "first backward: call penalized_loss again for another one.")
        given = [t for t in gradients if t is not None]  # None: a parameter the loss does not use
        scales = in_dtypes(scale, given)
        if ctx.hand_over:
            ctx.gradients = None
            torch._foreach_mul_(given, scales)
        else:
            given = torch._foreach_mul(given, scales)
        scaled = iter(given)
        return (None, None, None, *(None if t is None else next(scaled) for t in gradients))


def penalized_loss(penalty: GradientPenalty, at: LossAt, params: Sequence[Tensor], *,
                   retain_graph: bool = False, split: bool = False) -> tuple[Tensor, Tensor]:
    r"""``(task, weighted penalty)`` of the loss ``at`` (a :class:`LossAt`; its loss computed
    here where not given, the random state captured first) and ``penalty`` on
    ``points="parameters"``: their values are ``at.loss`` and ``penalty(at, params)``, and the
    backward of their sum gives the parameter gradient of ``at.loss + penalty(at, params)``.

    By ``method="finite_difference"`` (``needs_callable``) in two passes (module docstring): the
    task term carries :math:`\nabla L + c\,Hv` and the penalty none; with ``split`` the task
    term carries :math:`\nabla L` and the penalty :math:`c\,Hv` (for a per-term gradient split,
    one more parameter-sized buffer). The loss's graph is freed by the first pass unless
    ``retain_graph`` (other terms differentiating the same forward). By double backward: the
    loss and the penalty of its graph (no pass saved).

    Examples:
        >>> import torch
        >>> from gradreg.penalties import LossAt, param_grad_norm, penalized_loss
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Linear(3, 1).double()
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
        >>> params = list(model.parameters())
        >>> def loss(rows=slice(None)):
        ...     return torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        >>> norm = torch.cat([g.flatten() for g in torch.autograd.grad(loss(), params)]).norm()
        >>> gp = param_grad_norm(0.1, method="finite_difference")
        >>> task, penalty = penalized_loss(gp, LossAt.run(loss, x), params)
        >>> round(task.item(), 4), round(penalty.item(), 6) == round(0.1 * norm.item(), 6)
        (0.7568, True)
        >>> (task + penalty).backward()  # the step's gradient, carried by the task term
    """
    at, gradient, value = _two_passes("penalized_loss", penalty, at, params, retain_graph, split)
    if gradient is None:
        return at.loss, value
    return Carried.apply(at.loss.detach(), gradient, not split, *params), value


def penalized_backward(penalty: GradientPenalty, at: LossAt, params: Sequence[Tensor], *,
                       scale: float | Tensor | torch.amp.GradScaler | None = None
                       ) -> tuple[Tensor, Tensor]:
    r"""Add :math:`s\,\nabla_\theta (L + c\,P)` to each parameter's ``.grad`` (set where it is
    None, as ``backward`` does) and return ``(task, weighted penalty)``, detached: the backward
    of :func:`penalized_loss`'s terms, without an autograd node to carry the gradient to the
    parameters or a backward of the caller's. By ``method="finite_difference"`` the gradient is
    the paper's two passes (module docstring), added to ``.grad`` directly, through autograd's
    accumulation where something may watch it (a ``torch.distributed`` process group is
    initialized, e.g. DDP's reducer; a parameter has a hook); by double backward, the backward
    of :math:`s\,(L + c\,P)`.

    ``scale`` :math:`s`: what the step's gradient is multiplied by, as a ``backward`` of the
    scaled loss would: a ``torch.amp.GradScaler`` itself (its current scale, read as
    ``scaler.scale(loss).backward()`` reads it, without a host sync, which also starts the
    scaler so that ``scaler.step`` accepts the step), :math:`1/k` for :math:`k` accumulated
    micro-batches each penalizing its own gradient; 1 where None. Under float16 autocast it must
    be given: a ``GradScaler``'s step divides ``.grad`` by its scale.

    A GradScaler loop::

        scaler = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            penalized_backward(gnp, LossAt.run(loss_fn, x), params, scale=scaler)
        scaler.step(optimizer)
        scaler.update()

    Examples:
        The ``.grad`` of :func:`penalized_loss`'s backward, :math:`\nabla L + c\,H\hat g`
        (on the same random state: here the model draws none), then the optimizer's step:

        >>> import torch
        >>> from gradreg.penalties import (LossAt, param_grad_norm, penalized_backward,
        ...                                penalized_loss)
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> params = list(model.parameters())
        >>> gnp = param_grad_norm(0.01, method="finite_difference")
        >>> def loss():
        ...     return torch.nn.functional.cross_entropy(model(x), y)
        >>> task, penalty = penalized_backward(gnp, LossAt.run(loss, x), params)
        >>> grads = [p.grad for p in params]
        >>> model.zero_grad()
        >>> sum(penalized_loss(gnp, LossAt.run(loss, x), params)).backward()
        >>> all(torch.equal(a, p.grad) for a, p in zip(grads, params))
        True
        >>> torch.optim.SGD(params, lr=0.1).step()
    """
    params = list(params)
    scale = _backward_scale(scale, params)
    at, gradient, value = _two_passes("penalized_backward", penalty, at, params, False, False)
    if gradient is None:
        ((at.loss + value) * scale).backward()
        return at.loss.detach(), value.detach()
    given = [t for t in gradient if t is not None]  # None: a parameter the loss does not use
    if isinstance(scale, Tensor) and given:
        torch._foreach_mul_(given, in_dtypes(scale.to(given[0].device), given))
    elif not isinstance(scale, Tensor) and scale != 1.0:
        torch._foreach_mul_(given, scale)
    add_to_grad(params, gradient)
    return at.loss.detach(), value


def add_to_grad(params: Sequence[Tensor], gradients: Sequence[Tensor | None]) -> None:
    """``.grad += gradients`` (set where None, taking the gradients' memory), as ``backward``
    accumulates; through autograd's accumulation (:func:`torch.autograd.backward` of the
    parameters) where a hook may watch it: a ``torch.distributed`` process group is initialized
    (DDP's and FSDP's reducers hook the accumulation), or a parameter has a tensor or
    post-accumulate hook. A gradient None (a parameter the loss does not use) leaves ``.grad``
    as it is, as ``backward`` does."""
    pairs = [(p, g) for p, g in zip(params, gradients, strict=True) if g is not None]
    if _watched(params):
        torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])
        return
    for p, g in pairs:
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def _watched(params: Sequence[Tensor]) -> bool:
    """Whether a hook may watch the accumulation of ``params``' gradients."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return True
    return any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
               for p in params)


def _backward_scale(scale: float | Tensor | torch.amp.GradScaler | None, params: list[Tensor]
                    ) -> float | Tensor:
    """``scale``, a GradScaler's scale as the 0-dim tensor ``scaler.scale`` multiplies by (1 where
    it is disabled), 1.0 where None; refused where None under float16 autocast on the
    parameters' device (a ``GradScaler`` would divide an unscaled gradient by its scale)."""
    device = params[0].device if params else torch.device("cpu")
    if isinstance(scale, torch.amp.GradScaler):
        return scale.scale(torch.ones((), device=device))
    if scale is not None:
        return scale if isinstance(scale, Tensor) else float(scale)
    device = device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16:
        raise GradientError(
            "penalized_backward adds the unscaled gradient to .grad, and under float16 autocast a "
            "GradScaler's step divides .grad by its scale: pass scale=scaler (the GradScaler) "
            "(scale=1.0 where no GradScaler is used), or use penalized_loss and "
            "scaler.scale(task + penalty).backward().")
    return 1.0


def _two_passes(what: str, penalty: GradientPenalty, at: LossAt, params: list[Tensor],
                retain_graph: bool, split: bool) -> tuple[LossAt, list[Tensor] | None, Tensor]:
    """``at`` (its loss computed where not given, the random state captured first), the step's
    gradient by the penalty's two passes (None for a penalty by double backward, whose value
    carries its gradient) and the weighted penalty; ``what``: the caller, for the error."""
    if penalty.config.points != "parameters":
        raise GradientError(
            f"{what} takes a penalty on points='parameters', got "
            f"points={penalty.config.points!r}: call that penalty as penalty(outputs, points).")
    if at.loss is None:
        at = LossAt.run(at.fn, *params)
    if at.spent:
        raise GradientError(
            f"{what} was given a LossAt whose loss an earlier call differentiated and freed (a "
            "LossAt is one step's loss): compute LossAt.run(loss_fn, x) again for this call, or "
            "pass retain_graph=True to penalized_loss where two calls share one forward.")
    if not penalty.needs_callable:
        at.spent = what == "penalized_backward"  # whose backward frees the graph here
        return at, None, penalty(at.loss, params)
    value, gradient = penalty(at, params, task=TaskGradient(penalty.factor, retain_graph, split))
    at.spent = not retain_graph
    return at, gradient, value
