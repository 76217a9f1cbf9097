"""A GAN's samples over training: one grid of images of latents fixed at fit start."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from gradreg.lightning.callbacks._logging import (
    check_every,
    logging_due,
    logging_step,
    tensorboard,
    warn_without_tensorboard,
)
from gradreg.lightning.callbacks._penalties import penalty_weights
from gradreg.lightning.callbacks._probe import eval_mode
from gradreg.lightning.dashboards.figures import figure_title, samples_figure
from gradreg.lightning.dashboards.tags import SAMPLES


class SampleGrid(pl.Callback):
    """Images ``G(z)`` of ``num_samples`` latents fixed at fit start (seeded), one grid with gaps
    between the images and the step and the penalties' weights above it
    (:func:`~gradreg.lightning.dashboards.samples_figure`), tag ``samples``, every
    ``every_n_steps`` optimizer steps (``None``: ``log_every_n_steps``).

    Expects ``pl_module.generator`` (latents ``[N, latent_dim]`` to images ``[N, C, H, W]`` in
    [0, 1]; values outside are clipped) and ``pl_module.latent_dim``, as :class:`~gradreg.
    lightning.gan.GAN` has them. The same latents at every step show the samples evolve; at the
    end of training a last grid is logged if the last batch was not drawn.
    """

    def __init__(self, num_samples: int = 64, *, every_n_steps: int | None = None,
                 seed: int = 0) -> None:
        check_every(every_n_steps)
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}.")
        self.num_samples, self.every_n_steps, self.seed = num_samples, every_n_steps, seed
        self.latents: Tensor | None = None
        self._steps: tuple[int, int | None] | None = None  # the last batch's, the last drawn

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "SampleGrid", "sample grids")
        generator = torch.Generator().manual_seed(self.seed)
        self.latents = torch.randn(self.num_samples, pl_module.latent_dim, generator=generator)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = logging_step(trainer)
        drawn = self._steps[1] if self._steps else None
        self._steps = step, drawn
        if logging_due(trainer, self.every_n_steps):
            self._log(trainer, pl_module, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._steps is not None and self._steps[0] != self._steps[1]:
            self._log(trainer, pl_module, self._steps[0])

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        writer = tensorboard(trainer)
        if writer is None:
            return
        with eval_mode(pl_module.generator), torch.no_grad():
            images = pl_module.generator(self.latents.to(pl_module.device))
        if images.ndim != 4:
            raise ValueError(f"SampleGrid shows images, [N, C, H, W]; the generator made shape "
                             f"{list(images.shape)}.")
        images = images.clamp(0, 1).float().cpu().permute(0, 2, 3, 1)
        images = images[..., 0] if images.shape[-1] == 1 else images
        title = figure_title(step, penalty_weights(pl_module))
        writer.add_figure(SAMPLES, samples_figure(images.numpy(), title=title), step, close=True)
        self._steps = step, step
