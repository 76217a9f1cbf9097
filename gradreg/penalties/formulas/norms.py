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
    if p == 2:
        sq = None
        for f in flat:
            part = f.square().sum(1)
            sq = part if sq is None else sq + part
        if squared:
            return sq if per_sample else sq[0]
        norm = safe_sqrt(sq)
    else:
        if squared:
            raise ValueError("squared=True is only defined for p=2.")
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
    """sqrt with gradient 0 instead of inf at 0 (a subgradient), so penalties stay finite."""
    positive = sq != 0  # sq >= 0 or NaN: a NaN stays NaN (check_finite sees it), 0 -> 0
    return torch.where(positive, torch.where(positive, sq, 1.0).sqrt(), 0.0)


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
        deviation = deviation.clamp_min(0) if one_sided else deviation.abs()
        values = deviation if power == 1 else safe_pow(deviation, power)
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
