"""Evaluation metrics that show what a gradient penalty is for (plain torch functions).

Classifiers: accuracy on clean inputs and under the fast gradient sign method (FGSM), and the mean
input-gradient norm -- what double backpropagation and Jacobian penalties push down.
GANs on the 2D toy sets: modes covered and the share of high-quality samples (VEEGAN's and
PacGAN's metrics for mixtures of Gaussians), and the energy distance to held-out real samples,
defined for every toy set (the swiss roll has no modes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def fgsm(x: Tensor, grad: Tensor, eps: float, bounds: Sequence[float] | None = None) -> Tensor:
    r"""Goodfellow et al. 2015: :math:`x' = \mathrm{clip}(x + \epsilon\,\mathrm{sign}(\nabla_x L))`.

    ``grad`` is the gradient of the loss w.r.t. ``x``; ``bounds = (low, high)`` is the valid input
    range to clip to (``None``: no clipping).
    """
    adversarial = x.detach() + eps * grad.sign()
    return adversarial if bounds is None else adversarial.clamp(*bounds)


def accuracy(logits: Tensor, labels: Tensor) -> Tensor:
    """Share of samples whose largest logit is at the true label."""
    return (logits.argmax(dim=1) == labels).float().mean()


def mode_metrics(samples: Tensor, centers: Tensor, sigma: float) -> tuple[int, float]:
    r"""``(modes covered, share of high-quality samples)`` for a mixture of Gaussians.

    A sample is *high quality* when it lies within :math:`3\sigma` of its nearest center; a mode is
    *covered* when it is the nearest center of at least one high-quality sample (Srivastava et al.
    2017, VEEGAN, section 5.1).
    """
    distance, nearest = torch.cdist(samples.double(), centers.double().to(samples.device)).min(1)
    good = distance <= 3 * sigma
    return int(nearest[good].unique().numel()), float(good.double().mean())


def energy_distance(x: Tensor, y: Tensor) -> Tensor:
    r""":math:`2\,E\lVert X-Y\rVert - E\lVert X-X'\rVert - E\lVert Y-Y'\rVert` (V-statistic), >= 0.

    Zero if and only if the two distributions are equal (Székely & Rizzo 2013); computed from all
    pairs of the two samples, rows of ``x`` [n, d] and ``y`` [m, d].
    """
    x, y = x.double(), y.double()
    return 2 * torch.cdist(x, y).mean() - torch.cdist(x, x).mean() - torch.cdist(y, y).mean()
