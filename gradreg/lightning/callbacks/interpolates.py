r"""The quantity WGAN-GP controls: the critic's gradient norm at the interpolates, over training.

WGAN-GP penalizes :math:`(\lVert\nabla_{\hat x} D(\hat x)\rVert_2 - 1)^2` at
:math:`\hat x = x + u(\tilde x - x)`, :math:`u \sim U[0, 1)` per sample, between real samples
:math:`x` and fakes :math:`\tilde x = G(z)`. On Lightning's logging steps, after the batch's
optimizer steps, this callback draws its own probe: the training batch's reals, fakes of fresh
latents and fresh :math:`u` (from its own seeded generator, so the training's random numbers are
untouched), and the per-sample norms :math:`\lVert\nabla_{\hat x} D(\hat x)\rVert_2` with the
networks in eval mode (one extra forward and backward of the critic, one forward of the
generator). Tags: ``interpolates/grad_norm_mean`` next to ``interpolates/grad_norm_target`` (the
target of the module's penalty at the interpolates: 1 for WGAN-GP and WGAN-LP) in one chart, and
the histogram ``interpolates/grad_norm``. For a critic trained with another penalty (R1: the norm
at the reals towards 0) the mean is still what the critic's gradient does between the samples,
and no target is drawn.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from gradreg import gradient
from gradreg.lightning.callbacks._logging import (
    check_every,
    log_scalars,
    logging_due,
    logging_step,
    tensorboard,
    warn_without_tensorboard,
)
from gradreg.lightning.callbacks._penalties import named_penalties
from gradreg.lightning.callbacks._probe import eval_mode, module_attribute, real_samples
from gradreg.lightning.dashboards.tags import INTERPOLATES
from gradreg.penalties import interpolate, per_sample_norm


class InterpolatesGradientNorm(pl.Callback):
    r"""Log :math:`\lVert\nabla D(\hat x)\rVert_2` at WGAN-GP's interpolates (module docstring).

    Expects ``pl_module.critic``, ``pl_module.generator`` and ``pl_module.latent_dim`` (as
    :class:`~gradreg.lightning.gan.GAN` has them); the arguments name other attributes.

    Args:
        target: the norm drawn next to the mean; ``None``: the ``target`` of the module's
            penalty on ``points="interpolates"`` (WGAN-GP: 1), none if it has no such penalty.
        every_n_steps: the logging interval in optimizer steps; ``None`` follows the Trainer's
            ``log_every_n_steps``.
        seed: seed of the probe's latents and interpolation coefficients.
    """

    charts = ("interpolates",)

    def __init__(self, *, critic: str = "critic", generator: str = "generator",
                 latent_dim: str = "latent_dim", target: float | None = None,
                 every_n_steps: int | None = None, seed: int = 0) -> None:
        check_every(every_n_steps)
        self.attributes = {"critic": critic, "generator": generator, "latent_dim": latent_dim}
        self.target = None if target is None else float(target)
        self._target: float | None = self.target
        self.every_n_steps = every_n_steps
        self.seed = seed
        self.random: torch.Generator | None = None

    def _attribute(self, pl_module: pl.LightningModule, role: str, kind: type) -> Any:
        return module_attribute(pl_module, self.attributes[role], role, kind,
                                "InterpolatesGradientNorm")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "InterpolatesGradientNorm", "the histogram")
        for role, kind in (("critic", nn.Module), ("generator", nn.Module), ("latent_dim", int)):
            self._attribute(pl_module, role, kind)
        self.random = torch.Generator().manual_seed(self.seed)
        configs = [penalty.config for penalty in named_penalties(pl_module).values()]
        targets = {config.target for config in configs
                   if config.points == "interpolates" and isinstance(config.target, int | float)}
        self._target = self.target if self.target is not None or len(targets) != 1 else (
            float(targets.pop()))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if not logging_due(trainer, self.every_n_steps):
            return
        critic = self._attribute(pl_module, "critic", nn.Module)
        generator = self._attribute(pl_module, "generator", nn.Module)
        real = real_samples(batch)
        latents = torch.randn(len(real), self._attribute(pl_module, "latent_dim", int),
                              generator=self.random)
        alpha = torch.rand(len(real), generator=self.random)
        with eval_mode(critic, generator):
            with torch.no_grad():
                fake = generator(latents.to(real.device, real.dtype))
            with torch.enable_grad():
                points = interpolate(real, fake, alpha.to(real.device, real.dtype))
                scores = critic(points).reshape(len(real))
                norms = per_sample_norm(gradient(scores.sum(), points, create_graph=False))
        scalars = {f"{INTERPOLATES}/grad_norm_mean": norms.mean()}
        if self._target is not None:
            scalars[f"{INTERPOLATES}/grad_norm_target"] = self._target
        log_scalars(trainer, scalars)
        writer = tensorboard(trainer)
        if writer is not None:
            writer.add_histogram(f"{INTERPOLATES}/grad_norm", norms.float().cpu(),
                                 logging_step(trainer))
