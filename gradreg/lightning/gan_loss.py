r"""The whole GAN loss on one page: two phases, their adversarial terms and their penalties.

In the manner of NVlabs stylegan2-ada-pytorch ``training/loss.py``: what each phase computes is
data (the tables below), not branches spread over a trainer. For real samples :math:`x`, latents
:math:`z \sim N(0, I)` and fakes :math:`\tilde x = G(z)`:

* critic phase: :math:`L_D = \mathrm{mean}\, a_D(D(x), D(\tilde x)) + \sum_k P_k(D(p_k), p_k)`
  with :math:`\tilde x` detached and :math:`p_k` the points that penalty ``k`` asks for;
* generator phase: :math:`L_G = \mathrm{mean}\, a_G(D(G(z))) + \sum_k P_k(G(z), z)` (penalties
  on ``latents``: path length).

A forward that a due exact penalty differentiates twice runs its attention through
:func:`gradreg.differentiable_attention` (fused kernels have no double backward): the
penalty's own forwards, and the scores R1/R2 share below; every other forward keeps the fused
kernel.

Penalties at points of their own (interpolates, DRAGAN's perturbed reals) get the network itself
as ``outputs`` (a callable) and run its forward on their points. Penalties at the reals or the
fakes get the adversarial forward as one :class:`~gradreg.penalties.SharedForward` (the critic,
the samples, made points before that forward, their scores and the random state that forward
began with), and their method decides what to run, with no branch here: R1/R2 by double
backward differentiate the scores themselves, as in StyleGAN2 (a forward and a backward of the
critic saved); the finite difference and the perturbation estimate (``approx_r1``,
``approx_r2``) take the scores at the samples and run only the shifted forwards, replaying the
scores' random state (a critic with dropout: the function of the adversarial forward's mask);
``subsample``, ``chunks`` and the kinds run the critic again.

Adversarial terms :math:`(a_D, a_G)`, functions of the real and fake scores:

* ``wgan`` (Arjovsky et al. 2017): :math:`(D(\tilde x) - D(x),\; -D(\tilde x))`;
* ``nonsaturating`` (Goodfellow et al. 2014, the usual partner of R1/R2):
  :math:`(\mathrm{sp}(D(\tilde x)) + \mathrm{sp}(-D(x)),\; \mathrm{sp}(-D(\tilde x)))`,
  :math:`\mathrm{sp}` = softplus;
* ``relativistic`` (the relativistic pairing loss RpGAN, Jolicoeur-Martineau 2019; with R1 + R2 the
  R3GAN recipe, Huang et al. 2024): :math:`(\mathrm{sp}(D(\tilde x) - D(x)),\;
  \mathrm{sp}(D(x) - D(\tilde x)))`, pairing sample :math:`i` of each batch. Only this loss makes
  the generator phase score the reals (the critic frozen); the others skip that forward.

A penalty's weight, gain and lazy interval (``every``, StyleGAN2's lazy regularization) live on the
penalty itself: a penalty enters the sum only on the steps where ``gp.due()`` is True, scaled by
``every`` so its expected gradient is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradreg.attention import differentiable_attention
from gradreg.penalties import (
    GeneratorState,
    GradientPenalty,
    SharedForward,
    as_points,
    interpolate,
    perturb_dragan,
)

# name -> (a_D, a_G), each of (real scores, fake scores); a_G gets real=None unless the name is
# in PAIRED. Module-level functions, not lambdas: a GAN is pickled by ddp_spawn.
Term = Callable[[Tensor | None, Tensor], Tensor]


def _wgan_critic(real: Tensor, fake: Tensor) -> Tensor:
    return fake - real


def _wgan_generator(real: Tensor | None, fake: Tensor) -> Tensor:
    return -fake


def _nonsaturating_critic(real: Tensor, fake: Tensor) -> Tensor:
    return F.softplus(fake) + F.softplus(-real)


def _nonsaturating_generator(real: Tensor | None, fake: Tensor) -> Tensor:
    return F.softplus(-fake)


def _relativistic_critic(real: Tensor, fake: Tensor) -> Tensor:
    return F.softplus(fake - real)


def _relativistic_generator(real: Tensor, fake: Tensor) -> Tensor:
    return F.softplus(real - fake)


ADVERSARIAL: dict[str, tuple[Term, Term]] = {
    "wgan": (_wgan_critic, _wgan_generator),
    "nonsaturating": (_nonsaturating_critic, _nonsaturating_generator),
    "relativistic": (_relativistic_critic, _relativistic_generator),
}
PAIRED = ("relativistic",)


def _real_points(real: Tensor, fake: Tensor) -> Tensor:
    return as_points(real)


def _fake_points(real: Tensor, fake: Tensor) -> Tensor:
    return as_points(fake)


def _dragan_points(real: Tensor, fake: Tensor) -> Tensor:
    return perturb_dragan(real)


# points -> how to make them from (real, fake) in the critic phase
CRITIC_POINTS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "real": _real_points,
    "fake": _fake_points,
    "interpolates": interpolate,
    "perturbed": _dragan_points,
}
GENERATOR_POINTS = ("latents",)


class GANLoss:
    """The terms of each phase as a dict ``name -> scalar`` (``"adversarial"`` and penalty names).

    Random numbers are drawn in this order (global torch RNG): critic phase: ``z`` [B, latent_dim],
    then each due penalty's points in dict order (interpolation: one ``u`` per sample; DRAGAN:
    noise then ``alpha``); generator phase: ``z`` [B, latent_dim], then path length's projection.
    """

    def __init__(
        self,
        generator: nn.Module,
        critic: nn.Module,
        penalties: Mapping[str, GradientPenalty],
        *,
        adversarial: str = "wgan",
        latent_dim: int = 2,
    ) -> None:
        if adversarial not in ADVERSARIAL:
            raise ValueError(
                f"loss={adversarial!r} is unknown; valid values: {sorted(ADVERSARIAL)}"
            )
        self.generator, self.critic, self.penalties = generator, critic, penalties
        self.critic_term, self.generator_term = ADVERSARIAL[adversarial]
        self.paired = adversarial in PAIRED
        self.latent_dim = latent_dim

    def latents(self, like: Tensor) -> Tensor:
        """``z ~ N(0, I)``, one row per sample of ``like``."""
        return torch.randn(like.shape[0], self.latent_dim, dtype=like.dtype, device=like.device)

    def _due(self, points: Iterable[str]) -> dict[str, GradientPenalty]:
        return {k: gp for k, gp in self.penalties.items()
                if gp.config.points in points and gp.due()}

    def critic_terms(self, real: Tensor, loss_scale: float | None = None
                     ) -> dict[str, Tensor]:
        fake = self.generator(self.latents(real)).detach()
        due = self._due(CRITIC_POINTS)

        samples = {"real": real, "fake": fake}
        penalized = {gp.config.points for gp in due.values()} & set(samples)
        # the samples a due penalty is taken at are points before the adversarial forward, and
        # that forward's attention has a double backward where a penalty differentiates it twice
        twice = {gp.config.points for gp in due.values() if not gp.needs_callable} & penalized
        samples = {k: as_points(v) if k in penalized else v for k, v in samples.items()}
        scores, states = {}, {}
        for k, v in samples.items():
            states[k] = GeneratorState.capture(v)  # replayed by a penalty's other forwards
            with differentiable_attention() if k in twice else nullcontext():
                scores[k] = self.critic(v)
        terms = {"adversarial": self.critic_term(scores["real"], scores["fake"]).mean()}
        for name, gp in due.items():
            points = gp.config.points
            if points in samples:  # the adversarial forward: the method takes what it can of it
                at = samples[points]
                outputs = SharedForward(self.critic, at, scores[points], states[points])
            else:
                at, outputs = CRITIC_POINTS[points](real, fake), self.critic
            terms[name] = gp(outputs, at, loss_scale=loss_scale)
        return terms

    def generator_terms(self, real: Tensor, loss_scale: float | None = None
                        ) -> dict[str, Tensor]:
        z = self.latents(real)
        real_scores = self.critic(real) if self.paired else None
        terms = {"adversarial": self.generator_term(real_scores,
                                                    self.critic(self.generator(z))).mean()}
        for name, gp in self._due(GENERATOR_POINTS).items():
            terms[name] = gp(self.generator, as_points(z), loss_scale=loss_scale)
        return terms
