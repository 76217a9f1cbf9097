"""Where a penalty is evaluated: detached copies of data that require grad.

Each function returns a new leaf (``requires_grad=True``, no history), so the penalty's gradient
w.r.t. the points never flows back into a generator or a data pipeline.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["as_points", "interpolate", "perturb_dragan"]


def as_points(x: Tensor) -> Tensor:
    """``x`` itself as evaluation points (R1 on reals, R2 on fakes, double backprop on inputs)."""
    return x.detach().requires_grad_()


def _per_sample_uniform(x: Tensor, generator: torch.Generator | None) -> Tensor:
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    return torch.rand(shape, generator=generator, dtype=x.dtype, device=x.device)


def interpolate(real: Tensor, fake: Tensor, *, generator: torch.Generator | None = None) -> Tensor:
    r"""WGAN-GP's :math:`\hat x = x + u (\tilde x - x)`, one :math:`u \sim U[0, 1)` per sample."""
    if real.shape != fake.shape:
        raise ValueError(
            f"interpolation needs real and fake batches of the same shape, got {tuple(real.shape)} "
            f"and {tuple(fake.shape)}: generate as many fakes as there are reals (or slice both "
            "to the smaller batch)."
        )
    real, fake = real.detach(), fake.detach()
    return as_points(torch.lerp(real, fake, _per_sample_uniform(real, generator)))


def perturb_dragan(real: Tensor, *, generator: torch.Generator | None = None) -> Tensor:
    r"""DRAGAN's :math:`\tilde x = x + \alpha (x_p - x)`, :math:`x_p = x + 0.5\,\sigma(x)\,U[0,1)`.

    :math:`\sigma` is the standard deviation of the whole batch tensor with divisor :math:`N`
    (numpy's ``std``, not the Bessel-corrected one) and :math:`\alpha \sim U[0, 1)` one per
    sample, as in the reference implementation (Kodali et al. 2017:
    ``X + 0.5 * X.std() * np.random.random(X.shape)`` on numpy arrays).
    """
    real = real.detach()
    noise = torch.rand(real.shape, generator=generator, dtype=real.dtype, device=real.device)
    perturbed = real + 0.5 * real.std(correction=0) * noise
    return as_points(torch.lerp(real, perturbed, _per_sample_uniform(real, generator)))
