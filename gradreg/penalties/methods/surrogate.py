"""How a method hands a parameter gradient it computed ahead of the caller's backward to that one
backward: a value that carries given gradients (:func:`with_gradients`)."""

from __future__ import annotations

from torch import Tensor

__all__ = ["with_gradients"]


def with_gradients(value: Tensor, tensors: list[Tensor], gradients: list[Tensor]) -> Tensor:
    r"""``value`` (detached) plus a zero whose gradient w.r.t. each ``tensors[j]`` is
    ``gradients[j]``: :math:`v + S - \operatorname{detach}(S)`,
    :math:`S = \sum_j \langle t_j, \operatorname{detach}(G_j) \rangle`.

    Hands gradients computed ahead of time to the caller's one ``backward`` (scaled by whatever
    multiplies the value there). First order only: its own gradient is constant.

    Examples:
        >>> import torch
        >>> from gradreg.penalties.methods.surrogate import with_gradients
        >>> w = torch.ones(2, requires_grad=True)
        >>> carried = with_gradients(torch.tensor(5.0), [w], [torch.tensor([1.0, -2.0])])
        >>> carried.item()
        5.0
        >>> (3 * carried).backward()
        >>> w.grad
        tensor([ 3., -6.])
    """
    surrogate = sum((t * g.detach()).sum() for t, g in zip(tensors, gradients, strict=True))
    if not isinstance(surrogate, Tensor):  # nothing to carry
        return value.detach()
    return value.detach() + (surrogate - surrogate.detach())
