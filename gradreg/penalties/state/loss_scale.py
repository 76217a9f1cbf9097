r"""Gradients under an fp16 loss scale: PyTorch's gradient-penalty recipe in one place.

With a ``GradScaler`` of scale :math:`s`, small fp16 gradients would underflow; the penalty's
gradients are therefore taken of :math:`s \cdot y` and multiplied by :math:`1/s`, which leaves
their value unchanged (exactly so for the scaler's powers of two) and never calls
``scaler.unscale_``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

__all__ = ["LossScale", "unscaled"]

#: A GradScaler's scale (``scaler.get_scale()``), or ``None`` outside fp16 autocast.
LossScale = float | Tensor | None


def unscaled(differentiate: Callable[[Tensor], Sequence[Tensor | None]], value: Tensor,
             loss_scale: LossScale) -> tuple[Tensor | None, ...]:
    r"""``differentiate(value)``, or under a loss scale :math:`s` the gradients
    ``differentiate(value * s)`` times :math:`1/s` (``None`` entries, unused inputs, kept).

    Examples:
        >>> import torch
        >>> from gradreg.penalties.state.loss_scale import unscaled
        >>> x = torch.tensor([3.0], requires_grad=True)
        >>> unscaled(lambda v: torch.autograd.grad(v, [x]), (x**2).sum(), 1024.0)  # 2x
        (tensor([6.]),)
    """
    if loss_scale is None:
        return tuple(differentiate(value))
    inverse = 1.0 / loss_scale
    return tuple(None if g is None else g * inverse for g in differentiate(value * loss_scale))
