"""Per-sample gradient norms, with a root that stays differentiable at zero, and the penalty
of the norms (deviation from the target, power, reduction over samples)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradreg.autograd import gradient, nth_derivative
from gradreg.penalties.state.loss_scale import LossScale, unscaled

__all__ = [
    "REDUCE",
    "NormPenalty",
    "penalty_from_norms",
    "per_sample_norm",
    "per_sample_rows",
    "safe_pow",
    "safe_sqrt",
    "squared_norm_penalty",
    "unscaled_vjp",
]


def unscaled_vjp(outputs: Tensor, inputs: tuple[Tensor, ...], grad_outputs: Tensor,
                 loss_scale: LossScale) -> tuple[Tensor, ...]:
    """``gradient(outputs, inputs, grad_outputs)``, under a loss scale taken scaled and unscaled
    (:func:`~gradreg.penalties.state.loss_scale.unscaled`)."""
    return unscaled(lambda value: gradient(value, inputs, grad_outputs=grad_outputs), outputs,
                    loss_scale)


def gradient_norms(outputs: Tensor, inputs: tuple[Tensor, ...], *, p: float, squared: bool,
                   order: int = 1, count: int | None = None, per_sample: bool = True,
                   loss_scale: LossScale = None) -> Tensor:
    r"""Norms of :math:`g = \partial^n (\sum f) / \partial x^n`, per sample or one over
    everything (the ``"sum"`` projection; ``count`` does not apply), built with
    ``create_graph=True``; under a loss scale :math:`s` the gradient of :math:`s \sum f` times
    :math:`1/s` (:func:`~gradreg.penalties.state.loss_scale.unscaled`)."""
    if order == 1 and loss_scale is None:
        grads = gradient(outputs, inputs, grad_outputs=torch.ones_like(outputs))
    elif order == 1:
        grads = unscaled_vjp(outputs, inputs, torch.ones_like(outputs), loss_scale)
    else:
        grads = unscaled(lambda value: tuple(nth_derivative(value, x, order) for x in inputs),
                         outputs, loss_scale)
    return per_sample_norm(grads, p, squared=squared, per_sample=per_sample)


def per_sample_norm(
    grads: Tensor | Sequence[Tensor],
    p: float = 2.0,
    *,
    squared: bool = False,
    per_sample: bool = True,
) -> Tensor:
    r""":math:`\lVert g_i \rVert_p` over all non-batch dims of every tensor in ``grads``, shape [B].

    With ``squared=True`` (only for ``p=2``) returns :math:`\sum g_i^2` without a square root.
    The root has a finite gradient (zero) where the gradient vanishes, so a penalty stays finite
    for a model that is constant in its input. ``per_sample=False`` gives one norm over
    everything (shape []). A gradient of shape [B] (points of one scalar per sample) is one
    feature per sample: :math:`\lVert g_i \rVert_p = |g_i|`.

    Examples:
        >>> import torch
        >>> from gradreg.penalties import per_sample_norm
        >>> g = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
        >>> per_sample_norm(g), per_sample_norm(g, squared=True), per_sample_norm(g, p=1)
        (tensor([5., 0.]), tensor([25.,  0.]), tensor([7., 0.]))
    """
    # loops, not comprehensions: this runs on every penalty call
    flat = []
    for g in (grads,) if isinstance(grads, Tensor) else grads:
        flat.append(g.reshape(g.shape[0] if g.ndim else 1, -1) if per_sample
                    else g.reshape(1, -1))  # per_sample_rows
    if p == 2 and squared:
        sq = None
        for f in flat:
            part = f.square().sum(1)
            sq = part if sq is None else sq + part
        return sq if per_sample else sq[0]
    if squared:
        raise ValueError("squared=True is only defined for p=2.")
    if p == 2:
        norm = _RowNorm.apply(*flat)
    else:
        parts = [torch.linalg.vector_norm(f, ord=p, dim=1) for f in flat]
        norm = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(
            torch.stack(parts), ord=p, dim=0)
    return norm if per_sample else norm[0]


def squared_norm_penalty(target: float | str, power: float, p: float) -> bool:
    """Whether a penalty of these options is the squared 2-norm itself (target 0, power 2)."""
    return isinstance(target, (int, float)) and target == 0 and power == 2 and p == 2


def per_sample_rows(x: Tensor) -> Tensor:
    """``x`` as [B, features]: all non-batch dims flattened, a [B] tensor as one feature per
    sample (``flatten(1)`` refuses a 1-d tensor), a 0-d tensor as one sample of one feature."""
    return x.reshape(x.shape[0] if x.ndim else 1, -1)


def safe_sqrt(sq: Tensor) -> Tensor:
    """sqrt with gradient 0 instead of inf at 0 (a subgradient), so penalties stay finite; its
    derivative is differentiable again (:class:`_Sqrt`)."""
    return _Sqrt.apply(sq)


def _over(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator``, 0 where ``denominator`` is 0, in three kernels; for the
    forward of a derivative (autograd does not record it)."""
    return (numerator / denominator).masked_fill_(denominator == 0, 0)


def _over_differentiable(numerator: Tensor, denominator: Tensor) -> tuple[Tensor, Tensor]:
    """``(numerator / denominator, 1 / denominator)``, 0 where ``denominator`` is 0, with finite
    derivatives everywhere (the division is by 1 where ``denominator`` is 0): for a derivative's
    own backward, which autograd records where a higher order is taken."""
    zero = denominator == 0
    safe = torch.where(zero, torch.ones_like(denominator), denominator)
    inverse = torch.where(zero, torch.zeros_like(denominator), safe.reciprocal())
    return numerator * inverse, inverse


class _RowNorm(torch.autograd.Function):
    r"""``_RowNorm.apply(*rows)``: :math:`n_i = \sqrt{\sum_t \lVert r_{t,i} \rVert_2^2}` of
    tensors :math:`r_t` of shape [B, F_t], with the gradient
    :math:`\partial n_i / \partial r_{t,i} = r_{t,i} / n_i`, 0 where :math:`n_i = 0` (a
    subgradient: the penalty of a model constant in its input stays finite). One kernel forward
    and four backward for one tensor, as ``torch.linalg.vector_norm``'s own; the gradient is
    :class:`_ScaledRows`, differentiable again."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, *rows: Tensor) -> Tensor:
        if len(rows) == 1:
            norm = torch.linalg.vector_norm(rows[0], dim=1)
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(r, dim=1) for r in rows]), dim=0)
        ctx.save_for_backward(norm, *rows)
        return norm

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, ...]:
        norm, *rows = ctx.saved_tensors
        return _ScaledRows.apply(norm, grad, *rows)


class _ScaledRows(torch.autograd.Function):
    r"""``_ScaledRows.apply(n, c, *rows)``: :math:`r_{t,i}\, s_i` for every tensor of ``rows``,
    :math:`s_i = c_i / n_i` (0 where :math:`n_i = 0`): the gradient of :class:`_RowNorm`. Its
    backward, for upstream :math:`u_t`, with :math:`d_i = \sum_t \langle u_{t,i}, r_{t,i}
    \rangle`: :math:`u_t s` to the rows, :math:`d_i / n_i` to :math:`c` and
    :math:`-d_i c_i / n_i^2` to :math:`n` (all 0 where :math:`n_i = 0`), in differentiable ops."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, norm: Tensor, grad: Tensor,
                *rows: Tensor) -> tuple[Tensor, ...]:
        ctx.save_for_backward(norm, grad, *rows)
        scale = _over(grad, norm).unsqueeze(1)
        if len(rows) == 1:  # no generator: this runs on every penalty's backward
            return (rows[0] * scale,)
        return tuple(r * scale for r in rows)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 *upstream: Tensor | None) -> tuple[Tensor | None, ...]:
        norm, grad, *rows = ctx.saved_tensors
        scale, inverse = _over_differentiable(grad, norm)
        dot = None
        for u, r in zip(upstream, rows, strict=True):
            if u is not None:
                part = (u * r).sum(1)
                dot = part if dot is None else dot + part
        if dot is None:
            dot = torch.zeros_like(norm)
        by_rows = tuple(None if u is None else u * scale.unsqueeze(1) for u in upstream)
        return (-dot * scale * inverse, dot * inverse, *by_rows)


class _Sqrt(torch.autograd.Function):
    r"""``_Sqrt.apply(sq)``: :math:`\sqrt{q}` with the derivative :math:`1 / (2 \sqrt q)`, 0 at
    :math:`q = 0` (a NaN stays NaN); one kernel forward and four backward
    (:class:`_HalfOver`, differentiable again)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, sq: Tensor) -> Tensor:
        root = sq.sqrt()
        ctx.save_for_backward(root)
        return root

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        (root,) = ctx.saved_tensors
        return _HalfOver.apply(grad, root)


class _HalfOver(torch.autograd.Function):
    r"""``_HalfOver.apply(c, r)``: :math:`c / (2 r)`, 0 where :math:`r = 0`: the derivative of
    :class:`_Sqrt`. Its backward, for upstream :math:`u`: :math:`u / (2r)` to :math:`c` and
    :math:`-u c / (2 r^2)` to :math:`r` (0 where :math:`r = 0`), in differentiable ops."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor, root: Tensor) -> Tensor:
        ctx.save_for_backward(grad, root)
        return _over(grad, root).mul_(0.5)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 upstream: Tensor) -> tuple[Tensor, Tensor]:
        grad, root = ctx.saved_tensors
        scale, inverse = _over_differentiable(grad, root)
        half = upstream * inverse * 0.5
        return half, -half * scale


def safe_pow(deviation: Tensor, power: float) -> Tensor:
    """``deviation ** power`` for ``deviation >= 0``, with gradient 0 at 0 (a subgradient) for
    every power: below 1 torch's is infinite there (power * 0 ** (power - 1)), which times the
    zero derivative of ``abs`` or ``clamp_min`` at the kink gives NaN parameter gradients."""
    positive = deviation != 0  # a NaN stays NaN
    return torch.where(positive, torch.where(positive, deviation, 1.0).pow(power), 0.0)


#: The reductions over samples by name (``"max"``: Max-GP's largest per-sample value; ``"none"``:
#: the per-sample values).
REDUCE: dict[str, Callable[[Tensor], Tensor]] = {
    "mean": Tensor.mean, "sum": Tensor.sum, "max": Tensor.amax, "none": lambda values: values}


def penalty_from_norms(norms: Tensor, *, target: float | Tensor, one_sided: bool, power: float,
                       reduction: str, squared: bool) -> Tensor:
    r""":math:`\operatorname{reduce}_i \phi(n_i - c)^{\text{power}}` of the norms :math:`n_i`
    (the norms themselves where ``squared``: they are already the squared norms)."""
    if squared:  # target 0, power 2, p 2: the squared norm itself, no root
        values = norms
    else:
        deviation = norms - target
        if one_sided:
            deviation = deviation.clamp_min(0)
        elif power != 2:  # an even power needs no abs: |t|^2 = t^2, with the same derivative
            deviation = deviation.abs()
        values = (deviation if power == 1 else deviation.square() if power == 2
                  else safe_pow(deviation, power))
    if reduction not in REDUCE:
        raise ValueError(f"unknown reduction {reduction!r}; valid: {', '.join(map(repr, REDUCE))}.")
    return REDUCE[reduction](values)


@dataclass(frozen=True)
class NormPenalty:
    r"""The unweighted penalty as a pure function of the per-sample norms,
    :math:`\operatorname{reduce}_i \phi(n_i - c)^{\text{power}}` (:func:`penalty_from_norms`),
    or of the per-sample gradients themselves (:meth:`of_gradients`): what an estimate is given
    of the penalty, holding the options and nothing of the module (it pickles, and calls
    nothing back).

    Examples:
        WGAN-GP's formula of norms 3 and 2 (target 1), and R1's of a gradient (3, 4):

        >>> import torch
        >>> from gradreg.penalties.formulas.norms import NormPenalty
        >>> NormPenalty(target=1.0)(torch.tensor([3.0, 2.0]))  # ((3-1)^2 + (2-1)^2) / 2
        tensor(2.5000)
        >>> NormPenalty(target=0.0, squared=True).of_gradients((torch.tensor([[3.0, 4.0]]),))
        tensor(25.)
    """

    target: float
    one_sided: bool = False
    power: float = 2.0
    p: float = 2.0
    reduction: str = "mean"
    squared: bool = False

    def __call__(self, norms: Tensor, target: float | Tensor | None = None) -> Tensor:
        """The penalty of ``norms`` (squared where :attr:`squared`); ``target`` replaces the
        configured one (StyleGAN2's running mean, a tensor)."""
        return penalty_from_norms(norms, target=self.target if target is None else target,
                                  one_sided=self.one_sided, power=self.power,
                                  reduction=self.reduction, squared=self.squared)

    def of_gradients(self, grads: Tensor | Sequence[Tensor]) -> Tensor:
        """The penalty of the per-sample gradients ``grads`` (batch first), differentiable in
        them."""
        return self(per_sample_norm(grads, self.p, squared=self.squared))
