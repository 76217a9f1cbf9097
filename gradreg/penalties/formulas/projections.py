r"""Where the per-sample gradient :math:`g_i` of a penalty comes from: its ``projection``.

Each entry of :data:`PROJECTIONS` maps the per-sample ``outputs`` and the points ``inputs`` (a
tuple, batch first) to the per-sample norms :math:`\lVert g_i \rVert_p` (squared where the
configuration's ``squared`` says so), built with ``create_graph=True`` so that the penalty is
differentiable by double backward:

* ``"sum"`` (order ``n``): :math:`g_i = \partial^n (\sum f)/\partial x_i^n`;
* ``"orthonormal"``: :math:`\lVert g_i\rVert^2 = \frac{K}{n}\sum_j \lVert v_{ij}^\top J_i\rVert^2`
  for ``count`` = n orthonormal directions drawn uniformly per sample (default 1);
* ``"gaussian"``: :math:`g_i = J_i^\top y_i`, :math:`y_i \sim N(0, I)/\sqrt{\text{pixels}}`.

A new kind of norm is one more entry: a function ``(outputs, inputs, *, p, squared, order,
count, per_sample, loss_scale)`` (the norm's options) that returns one norm per sample (or one in
all without ``per_sample``: ``points="parameters"``); its key is the name the
:class:`~gradreg.penalties.formulas.options.Norm` takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from gradreg.autograd import GradientError
from gradreg.penalties.formulas.norms import (
    gradient_norms,
    per_sample_norm,
    per_sample_rows,
    safe_sqrt,
    unscaled_vjp,
)
from gradreg.penalties.state.loss_scale import LossScale

__all__ = ["DEFAULT_COUNT", "PROJECTIONS", "gaussian_vjp", "latent_length",
           "latent_sq_length", "projected_sq_norm"]

#: Orthonormal projections per sample where ``count`` is left out.
DEFAULT_COUNT = 1


def _orthonormal(outputs: Tensor, inputs: tuple[Tensor, ...], *, p: float, squared: bool,
                 order: int, count: int | None, per_sample: bool,
                 loss_scale: LossScale) -> Tensor:
    sq = projected_sq_norm(outputs, inputs, "orthonormal",
                           DEFAULT_COUNT if count is None else count, loss_scale)
    return sq if squared else safe_sqrt(sq)


def _gaussian(outputs: Tensor, inputs: tuple[Tensor, ...], *, p: float, squared: bool,
              order: int, count: int | None, per_sample: bool,
              loss_scale: LossScale) -> Tensor:
    grads = gaussian_vjp(outputs, inputs, loss_scale)
    return latent_sq_length(grads) if squared else latent_length(grads)


def _draw_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype random directions are drawn in: ``dtype``, widened to float32 where narrower
    (read off the dtype's size, without a call into torch's dispatcher)."""
    return dtype if dtype.itemsize >= 4 else torch.float32


def gaussian_vjp(outputs: Tensor, inputs: tuple[Tensor, ...],
                 loss_scale: LossScale = None) -> tuple[Tensor, ...]:
    r""":math:`J_i^\top y_i` at each of ``inputs``: the gradients of ``outputs`` [B, ...] with
    StyleGAN2's random image :math:`y_i \sim N(0, I)/\sqrt{\text{pixels}}` as the vector
    (pixels = H*W for images [B, C, H, W], the feature count otherwise), drawn in at least
    float32 and cast to the outputs' dtype, built with ``create_graph=True``."""
    flat = outputs.reshape(outputs.shape[0], -1)
    pixels = math.prod(outputs.shape[2:]) if outputs.ndim > 2 else flat.shape[1]
    noise = torch.randn(flat.shape, dtype=_draw_dtype(flat.dtype), device=flat.device)
    return unscaled_vjp(flat, inputs, (noise / math.sqrt(pixels)).to(flat.dtype), loss_scale)


def projected_sq_norm(outputs: Tensor, inputs: tuple[Tensor, ...], projection: str,
                      count: int = 1, loss_scale: LossScale = None) -> Tensor:
    """Squared per-sample norm of J^T v for random v (see the module docstring).

    The random directions are drawn in at least float32 and then cast to the outputs' dtype:
    under bf16/fp16 autocast the draws are those of a float32 run with the same seed (torch's
    generators do not promise the same numbers for a half-precision ``randn``; torch 2.11 gives
    different ones), and the QR of the orthonormal directions is taken in float32.
    """
    batch = outputs.shape[0]
    flat = outputs.reshape(batch, -1)
    k = flat.shape[1]
    if projection == "gaussian":
        return latent_sq_length(gaussian_vjp(outputs, inputs, loss_scale))
    if count > k:
        raise GradientError(
            f"count={count} exceeds the {k} outputs per sample: "
            f"at most {k} orthonormal directions exist (and {k} gives the exact norm)."
        )
    gaussian = torch.randn(batch, k, count, dtype=_draw_dtype(flat.dtype), device=flat.device)
    directions = torch.linalg.qr(gaussian).Q.to(flat.dtype)  # [B, K, n], orthonormal, uniform
    sq = sum(
        per_sample_norm(unscaled_vjp(flat, inputs, directions[:, :, j], loss_scale), squared=True)
        for j in range(count)
    )
    return sq * (k / count)


def latent_sq_length(grads: tuple[Tensor, ...]) -> Tensor:
    r"""Per-sample squared length of latent gradients, StyleGAN2's ``pl_lengths ** 2``.

    A latent of shape [B, num_ws, w_dim] (StyleGAN2's W+: one w per synthesis layer) gives
    :math:`\frac{1}{\text{num\_ws}} \sum_{l} \lVert g_{il} \rVert^2`, the mean over the layers
    of the squared norm over ``w_dim`` (``pl_grads.square().sum(2).mean(1)``); [B, w_dim] is
    the same with one layer, i.e. the squared norm. Other shapes take all non-batch dims.
    """
    total = None
    for g in grads:  # a loop, not sum(): no 0 + the first term
        part = g.square().sum(2).mean(1) if g.ndim == 3 else per_sample_rows(g).square().sum(1)
        total = part if total is None else total + part
    return total


def latent_length(grads: tuple[Tensor, ...]) -> Tensor:
    r"""Per-sample length of latent gradients, StyleGAN2's ``pl_lengths``: the root of
    :func:`latent_sq_length`, as one 2-norm of the rows, a W+ latent's scaled by
    :math:`1/\sqrt{\text{num\_ws}}` (:math:`\sqrt{\frac{1}{L}\sum_l \lVert g_{il}\rVert^2} =
    \lVert g_i \rVert / \sqrt{L}`), with gradient 0 where the gradient vanishes
    (:func:`~gradreg.penalties.formulas.norms.per_sample_norm`)."""
    return per_sample_norm(tuple(g / math.sqrt(g.shape[1]) if g.ndim == 3 else g
                                 for g in grads))

Norms = Callable[..., Tensor]
#: The projections by name: how each computes the per-sample norms (module docstring).
PROJECTIONS: dict[str, Norms] = {"sum": gradient_norms, "orthonormal": _orthonormal,
                                 "gaussian": _gaussian}
