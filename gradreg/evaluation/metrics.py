"""Evaluation metrics that show what a gradient penalty is for (plain torch functions).

Classifiers: accuracy on clean inputs, under the fast gradient sign method (FGSM) and under
projected gradient descent (PGD, the stronger multi-step attack), and the mean input-gradient norm
-- what double backpropagation and Jacobian penalties push down.
GANs on the 2D toy sets: modes covered and the share of high-quality samples (VEEGAN's and
PacGAN's metrics for mixtures of Gaussians), and the energy distance to held-out real samples,
defined for every toy set (the swiss roll has no modes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from gradreg import gradient
from gradreg.penalties import as_points


def fgsm(x: Tensor, grad: Tensor, eps: float, bounds: Sequence[float] | None = None) -> Tensor:
    r"""Goodfellow et al. 2015: :math:`x' = \mathrm{clip}(x + \epsilon\,\mathrm{sign}(\nabla_x L))`.

    ``grad`` is the gradient of the loss w.r.t. ``x``; ``bounds = (low, high)`` is the valid input
    range to clip to (``None``: no clipping).
    """
    adversarial = x.detach() + eps * grad.sign()
    return adversarial if bounds is None else adversarial.clamp(*bounds)


def pgd(
    loss: Callable[[Tensor], Tensor],
    x: Tensor,
    eps: float,
    *,
    steps: int = 10,
    step_size: float | None = None,
    bounds: Sequence[float] | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""Madry et al. 2018: ``steps`` of projected sign-gradient ascent in an L-inf ball.

    .. math::

        x^0 = \Pi(x + u),\ u \sim U[-\epsilon, \epsilon]^d, \qquad
        x^{t+1} = \Pi\big(x^t + \alpha\,\mathrm{sign}(\nabla_{x^t} L(x^t))\big),

    where :math:`\Pi` projects onto :math:`\lVert x' - x\rVert_\infty \le \epsilon` and clips to
    ``bounds``, and :math:`\alpha` = ``step_size``, by default :math:`2.5\,\epsilon / k` (Madry et
    al.: enough to cross the ball from any start). ``loss(x')`` returns the *summed* loss of the
    batch, so for a model whose samples do not interact row ``i`` of the gradient is sample ``i``'s.
    ``generator`` draws the random start (keep evaluation off the training RNG). With ``eps = 0``
    the inputs come back unchanged.
    """
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"pgd steps must be an integer >= 1, got {steps!r}")
    x = x.detach()
    alpha = 2.5 * eps / steps if step_size is None else step_size

    def project(candidate: Tensor) -> Tensor:
        inside = torch.minimum(torch.maximum(candidate, x - eps), x + eps)
        return inside if bounds is None else inside.clamp(*bounds)

    start = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    adversarial = project(x + eps * (2 * start - 1))
    for _ in range(steps):
        adversarial = as_points(adversarial)
        grad = gradient(loss(adversarial), adversarial, create_graph=False)
        adversarial = project(adversarial.detach() + alpha * grad.sign())
    return adversarial


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
