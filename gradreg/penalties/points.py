"""Where a penalty is evaluated: detached copies of data that require grad.

Each function returns a new leaf (``requires_grad=True``, no history), so the penalty's gradient
w.r.t. the points never flows back into a generator or a data pipeline. ``as_points`` takes data
without a graph; a tensor that carries one (a generator's fakes, a model's embeddings) is refused
rather than cut silently: cutting it would also cut the task loss's gradient to whatever computed
the tensor. A tensor inside a model is a point as it is (it requires grad already, and the penalty
differentiates w.r.t. it with its graph kept); R2's fakes are ``as_points(fakes.detach())``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradreg.autograd import GradientError

__all__ = ["as_points", "interpolate", "perturb_dragan"]


def as_points(x: Tensor) -> Tensor:
    """``x`` itself as evaluation points (R1 on reals, R2 on fakes, double backprop on inputs): a
    detached copy that requires grad.

    ``x`` must carry no graph (``x.grad_fn is None``): data, or fakes detached from their
    generator. A tensor computed with a graph is refused, since the copy would cut that graph
    and with it the task loss's gradient to what computed ``x`` (an embedding matrix); such a
    tensor is a point as it is: pass ``x`` itself to the penalty.

    Examples:
        >>> import torch
        >>> from gradreg.penalties import as_points
        >>> data = torch.ones(4, 3)
        >>> x = as_points(data)
        >>> x.requires_grad, x.is_leaf, x is data
        (True, True, False)
    """
    _require_floating("as_points", x)
    if x.grad_fn is not None:
        raise GradientError(
            f"as_points got a tensor with a graph (grad_fn={type(x.grad_fn).__name__}): its "
            "detached copy would cut that graph, and the loss's gradient to what computed it "
            "(e.g. an embedding matrix) would be lost. To penalize at an intermediate tensor "
            "such as embeddings, pass the tensor itself as the points (it already requires "
            "grad); for points that must not carry a gradient back (R2's fakes), detach "
            "explicitly: as_points(fakes.detach())."
        )
    return x.detach().requires_grad_()


def _require_floating(who: str, *tensors: Tensor) -> None:
    for x in tensors:
        if not isinstance(x, Tensor) or not x.is_floating_point():
            what = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise GradientError(
                f"{who} needs floating-point batches, got {what}: gradients exist for floating "
                "point only. Convert the data first, e.g. images.float() / 255."
            )


def _per_sample_uniform(x: Tensor, generator: torch.Generator | None) -> Tensor:
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    return torch.rand(shape, generator=generator, dtype=x.dtype, device=x.device)


def _coefficients(alpha: float | Tensor, like: Tensor) -> Tensor:
    """``alpha`` as a tensor broadcastable to ``like`` with one value per sample (or one for all),
    checked to lie in [0, 1] (on the CPU; on a GPU the check would wait for the device)."""
    if not isinstance(alpha, Tensor):
        alpha = torch.tensor(float(alpha), dtype=like.dtype, device=like.device)
    if alpha.ndim == 1 and alpha.shape[0] == like.shape[0]:
        alpha = alpha.view((-1,) + (1,) * (like.ndim - 1))
    per_sample = alpha.ndim == like.ndim and alpha.shape[0] in (1, like.shape[0]) and all(
        s == 1 for s in alpha.shape[1:])
    if alpha.ndim != 0 and not per_sample:
        raise GradientError(
            f"alpha has shape {tuple(alpha.shape)}; it must be a number, one value per sample "
            f"([{like.shape[0]}]) or a broadcastable [{like.shape[0]}{', 1' * (like.ndim - 1)}]."
        )
    if alpha.device.type == "cpu" and not bool(((alpha >= 0) & (alpha <= 1)).all()):
        raise GradientError(
            f"alpha must lie in [0, 1] (it is an interpolation coefficient), got values in "
            f"[{float(alpha.min())}, {float(alpha.max())}]."
        )
    return alpha.to(like.dtype)


def interpolate(real: Tensor, fake: Tensor, alpha: float | Tensor | None = None, *,
                alpha_on: str = "fake", generator: torch.Generator | None = None) -> Tensor:
    r"""WGAN-GP's points on the segments between real and fake samples, as detached leaves.

    With ``alpha_on="fake"`` (default) :math:`\hat x = x + \alpha (\tilde x - x)`, the
    WGAN-GP paper's code (``real + alpha * (fake - real)``; computed by ``torch.lerp``); with
    ``alpha_on="real"`` :math:`\hat x = \alpha x + (1 - \alpha) \tilde x`, computed exactly as
    StudioGAN, mmagic and most PyTorch scripts write it (``alpha * real + (1 - alpha) * fake``).
    ``x`` = ``real``, :math:`\tilde x` = ``fake``. ``alpha``: ``None`` draws one
    :math:`\alpha \sim U[0, 1)` per sample (from ``generator``); or a number in [0, 1], or one
    value per sample (shape ``[B]`` or ``[B, 1, ..., 1]``), to reproduce a script's own draws.

    Examples:
        >>> import torch
        >>> from gradreg.penalties import interpolate
        >>> real, fake = torch.zeros(2, 3), torch.ones(2, 3)
        >>> interpolate(real, fake, torch.tensor([0.25, 1.0]))  # x + alpha (x~ - x)
        tensor([[0.2500, 0.2500, 0.2500],
                [1.0000, 1.0000, 1.0000]], requires_grad=True)
    """
    if real.shape != fake.shape:
        raise ValueError(
            f"interpolation needs real and fake batches of the same shape, got {tuple(real.shape)} "
            f"and {tuple(fake.shape)}: generate as many fakes as there are reals (or slice both "
            "to the smaller batch)."
        )
    if alpha_on not in ("fake", "real"):
        raise ValueError(f"alpha_on must be 'fake' or 'real' (the side alpha weighs), got "
                         f"{alpha_on!r}.")
    _require_floating("interpolate", real, fake)
    real, fake = real.detach(), fake.detach()
    alpha = _per_sample_uniform(real, generator) if alpha is None else _coefficients(alpha, real)
    if alpha_on == "fake":
        return as_points(torch.lerp(real, fake, alpha))
    return as_points(alpha * real + (1 - alpha) * fake)


def perturb_dragan(real: Tensor, *, generator: torch.Generator | None = None) -> Tensor:
    r"""DRAGAN's :math:`\tilde x = x + \alpha (x_p - x)`, :math:`x_p = x + 0.5\,\sigma(x)\,U[0,1)`.

    :math:`\sigma` is the standard deviation of the whole batch tensor with divisor :math:`N`
    (numpy's ``std``, not the Bessel-corrected one) and :math:`\alpha \sim U[0, 1)` one per
    sample, as in the reference implementation (Kodali et al. 2017:
    ``X + 0.5 * X.std() * np.random.random(X.shape)`` on numpy arrays).

    Examples:
        >>> import torch
        >>> from gradreg.penalties import perturb_dragan
        >>> real = torch.tensor([[0.0, 2.0], [2.0, 0.0]])  # std 1 (divisor N)
        >>> shift = perturb_dragan(real) - real  # alpha * 0.5 * 1 * U[0, 1): in [0, 0.5)
        >>> bool(((shift >= 0) & (shift < 0.5)).all())
        True
    """
    _require_floating("perturb_dragan", real)
    real = real.detach()
    noise = torch.rand(real.shape, generator=generator, dtype=real.dtype, device=real.device)
    perturbed = real + 0.5 * real.std(correction=0) * noise
    return as_points(torch.lerp(real, perturbed, _per_sample_uniform(real, generator)))
