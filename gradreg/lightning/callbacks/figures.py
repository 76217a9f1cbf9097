r"""Figures over training: input-gradient saliency maps and a 2D critic's landscape.

The first two draw every ``log_every_n_steps`` optimizer steps (or ``every_n_steps``) after the
training batch, and once more at the end of training if the last batch was not drawn (so a run
shorter than the interval has its figure too), with the networks in eval mode, and log matplotlib
figures with ``add_figure`` (and to MLflow, W&B and CSV loggers as images,
:mod:`gradreg.lightning.dashboards.artifacts`); the Images tab's slider then plays them over
training. Each figure
says its step and the penalties' weights, and keeps its colour scale over training, so frames and
runs with and without a penalty compare.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from matplotlib.figure import Figure
from torch import Tensor, nn

from gradreg import gradient
from gradreg.lightning.callbacks._logging import check_every, logging_due, logging_step
from gradreg.lightning.callbacks._penalties import penalty_weights
from gradreg.lightning.callbacks._probe import (
    LossFn,
    cross_entropy_per_sample,
    eval_mode,
    input_gradients,
    module_attribute,
    real_samples,
    split_batch,
)
from gradreg.lightning.dashboards.artifacts import keeps_figures, log_figure
from gradreg.lightning.dashboards.figures import (
    critic_landscape_figure,
    figure_title,
    saliency_figure,
)
from gradreg.lightning.dashboards.tags import CRITIC_LANDSCAPE, SALIENCY
from gradreg.penalties import as_points


class _FigureLogger(pl.Callback):
    """Log ``self.draw(pl_module, batch, title)`` (tag -> figure) after the training batches that
    are due, and after the last batch at the end of training if it was not drawn."""

    def __init__(self, every_n_steps: int | None) -> None:
        check_every(every_n_steps)
        self.every_n_steps = every_n_steps
        self._last: tuple[Any, int] | None = None  # the last training batch and its step
        self._drawn_step: int | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not keeps_figures(trainer):
            rank_zero_warn(
                f"{type(self).__name__} writes figures, but the Trainer has no logger that keeps "
                "them (TensorBoard, MLflow, W&B, CSV), so they are not logged. Pass "
                "logger=TensorBoardLogger(save_dir) to the Trainer."
            )

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._last = batch, logging_step(trainer)
        if logging_due(trainer, self.every_n_steps):
            self._log(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._last is not None and self._drawn_step != self._last[1]:
            self._log(trainer, pl_module)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not keeps_figures(trainer) or self._last is None:
            return
        batch, step = self._last
        figures = self.draw(pl_module, batch, figure_title(step, penalty_weights(pl_module)))
        for tag, figure in figures.items():
            log_figure(trainer, tag, figure, step)
        if figures:
            self._drawn_step = step

    def draw(self, pl_module: pl.LightningModule, batch: Any, title: str) -> dict[str, Figure]:
        raise NotImplementedError


def _as_images(x: Tensor, image_shape: Sequence[int] | None) -> Tensor:
    """``[N, H, W]`` or ``[N, H, W, C]`` from ``[N, ...]`` inputs (reshaped to ``image_shape``)."""
    if image_shape is not None:
        if math.prod(image_shape) != x[0].numel():
            raise ValueError(
                f"image_shape={tuple(image_shape)} has {math.prod(image_shape)} values, but one "
                f"input has {x[0].numel()} (shape {list(x.shape[1:])}); give the input's shape."
            )
        x = x.reshape(len(x), *image_shape)
    if x.ndim == 4:
        x = x.permute(0, 2, 3, 1)
        return x[..., 0] if x.shape[-1] == 1 else x
    if x.ndim == 3:
        return x
    raise ValueError(
        f"SaliencyMaps draws images, [N, H, W] or [N, C, H, W], but the inputs have shape "
        f"{list(x.shape)}; pass image_shape=(H, W) or (C, H, W) to reshape flat inputs."
    )


class SaliencyMaps(_FigureLogger):
    r"""Inputs over :math:`\lvert\nabla_{x_i}\ell(f(x_i), y_i)\rvert`, tag ``saliency``.

    The images are the first ``num_images`` of the first validation batch (seen during the
    sanity check or the first validation), the same ones all run long; ``f`` is the module's
    ``forward``. For several channels the saliency is the largest magnitude over channels. The
    colour scale of the maps is ``[0, vmax]``, stated on the colour bar: given, it is the same
    for every run (runs of a sweep compare side by side: a penalty that halves the input
    gradient shows half as bright); ``None``, it is fixed by the run's first figure (``[0, its
    largest value]``), so that its frames compare over training, but not with other runs.
    Larger values show at the top colour (the colour bar's arrow).

    Args:
        num_images: how many images to show.
        image_shape: ``(H, W)`` or ``(C, H, W)`` of one input, for flat ``[N, D]`` inputs.
        loss_fn: ``(outputs, targets) -> per-sample losses [B]``; default cross-entropy.
        every_n_steps: drawing interval in optimizer steps; ``None``: ``log_every_n_steps``.
        vmax: the top of the colour scale, the same for every run; ``None``: the run's first
            figure's largest value.
    """

    def __init__(
        self,
        num_images: int = 8,
        *,
        image_shape: Sequence[int] | None = None,
        loss_fn: LossFn = cross_entropy_per_sample,
        every_n_steps: int | None = None,
        vmax: float | None = None,
    ) -> None:
        super().__init__(every_n_steps)
        if not isinstance(num_images, int) or num_images < 1:
            raise ValueError(f"num_images must be an int >= 1, got {num_images!r}.")
        if vmax is not None and not (isinstance(vmax, int | float) and math.isfinite(vmax)
                                     and vmax > 0):
            raise ValueError(f"vmax must be a finite number > 0 (the top of the colour scale), "
                             f"or None for the first figure's largest value; got {vmax!r}.")
        self.vmax = None if vmax is None else float(vmax)
        self.num_images = num_images
        self.image_shape = None if image_shape is None else tuple(image_shape)
        self.loss_fn = loss_fn
        self.batch: tuple[Tensor, Tensor] | None = None
        self.scale: float | None = None

    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.batch is None:
            inputs, targets = split_batch(batch, "SaliencyMaps")
            _as_images(inputs, self.image_shape)  # a wrong shape fails here, not mid-training
            self.batch = inputs[: self.num_images], targets[: self.num_images]

    def draw(self, pl_module: pl.LightningModule, batch: Any, title: str) -> dict[str, Figure]:
        if self.batch is None:
            return {}
        inputs, targets = self.batch
        grads = input_gradients(pl_module, inputs, targets, self.loss_fn)
        images = _as_images(inputs.detach(), self.image_shape).float()
        saliency = _as_images(grads.abs(), self.image_shape)
        if saliency.ndim == 4:
            saliency = saliency.amax(dim=-1)
        low = images.flatten(1).amin(1).view(-1, *[1] * (images.ndim - 1))
        high = images.flatten(1).amax(1).view(-1, *[1] * (images.ndim - 1))
        images = (images - low) / (high - low).clamp_min(1e-12)
        labels = targets.tolist() if targets.ndim == 1 else None
        if self.vmax is not None:
            self.scale, stated = self.vmax, f"fixed scale [0, {self.vmax:g}]"
        else:
            if self.scale is None:
                self.scale = float(saliency.max()) or 1.0
            stated = f"scale of this run's first figure [0, {self.scale:.2g}]"
        return {SALIENCY: saliency_figure(images.cpu().numpy(), saliency.cpu().numpy(), labels,
                                          vmax=self.scale, scale=stated, title=title)}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self.batch is None and keeps_figures(trainer):
            rank_zero_warn(
                "SaliencyMaps saw no validation batch, so it drew nothing: give the module or "
                "datamodule a val_dataloader (and limit_val_batches > 0)."
            )


class CriticLandscape(_FigureLogger):
    r"""A 2D critic :math:`D`: scores and :math:`\lVert\nabla_x D\rVert` on a grid, with samples.

    Expects ``pl_module.critic`` (``[N, 2] -> [N]`` or ``[N, 1]`` scores), ``pl_module.generator``
    (``[N, latent_dim] -> [N, 2]``) and ``pl_module.latent_dim`` (an int); other attribute names
    are given with ``critic``, ``generator`` and ``latent_dim``. Real samples are the current
    training batch (the batch itself, or its first entry); fake ones the generator's images of
    ``num_fake`` latents fixed at fit start (seeded), so the figures show the same points move.
    Two images: ``critic_landscape/score``, on a colour scale centred on each frame's median
    score (a critic's offset is arbitrary) whose half-width is fixed by the first frame, and
    ``critic_landscape/grad_norm`` on the fixed scale ``[0, max_grad_norm]``.

    Args:
        resolution: grid points per axis.
        extent: ``(xmin, xmax, ymin, ymax)``; ``None``: the first figure's real samples plus a
            margin, then fixed so that frames compare (fakes outside are counted in the
            legend).
        every_n_steps: drawing interval in optimizer steps; ``None``: ``log_every_n_steps``.
        seed: seed of the fixed latents.
        max_grad_norm: the top of the gradient norm's colour scale (WGAN-GP's target 1 in the
            middle by default).
    """

    def __init__(
        self,
        *,
        critic: str = "critic",
        generator: str = "generator",
        latent_dim: str = "latent_dim",
        num_fake: int = 256,
        resolution: int = 48,
        extent: Sequence[float] | None = None,
        every_n_steps: int | None = None,
        seed: int = 0,
        max_grad_norm: float = 2.0,
    ) -> None:
        super().__init__(every_n_steps)
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}.")
        if extent is not None and (len(extent) != 4 or extent[0] >= extent[1]
                                   or extent[2] >= extent[3]):
            raise ValueError(f"extent must be (xmin, xmax, ymin, ymax) with min < max, "
                             f"got {extent!r}.")
        if resolution < 2 or num_fake < 1:
            raise ValueError(f"resolution must be >= 2 and num_fake >= 1, got {resolution!r} "
                             f"and {num_fake!r}.")
        self.attributes = {"critic": critic, "generator": generator, "latent_dim": latent_dim}
        self.num_fake = num_fake
        self.resolution = resolution
        self.extent = None if extent is None else tuple(float(v) for v in extent)
        self.seed = seed
        self.max_grad_norm = float(max_grad_norm)
        self.score_half_width: float | None = None
        self.latents: Tensor | None = None

    def _attribute(self, pl_module: pl.LightningModule, role: str, kind: type) -> Any:
        return module_attribute(pl_module, self.attributes[role], role, kind, "CriticLandscape")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._attribute(pl_module, "critic", nn.Module)
        self._attribute(pl_module, "generator", nn.Module)
        latent_dim = self._attribute(pl_module, "latent_dim", int)
        generator = torch.Generator().manual_seed(self.seed)
        self.latents = torch.randn(self.num_fake, latent_dim, generator=generator)

    def draw(self, pl_module: pl.LightningModule, batch: Any, title: str) -> dict[str, Figure]:
        critic = self._attribute(pl_module, "critic", nn.Module)
        generator = self._attribute(pl_module, "generator", nn.Module)
        real = real_samples(batch)
        if real.ndim != 2 or real.shape[1] != 2:
            raise ValueError(f"CriticLandscape draws 2D data, [N, 2] samples; the batch has shape "
                             f"{list(real.shape)}.")
        with eval_mode(critic, generator):
            with torch.no_grad():
                fake = generator(self.latents.to(real.device, real.dtype))
            if self.extent is None:  # the data's, not the first (untrained) fakes'
                self.extent = _extent(real)
            xs = torch.linspace(*self.extent[:2], self.resolution, dtype=real.dtype)
            ys = torch.linspace(*self.extent[2:], self.resolution, dtype=real.dtype)
            grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
            with torch.enable_grad():
                points = as_points(torch.stack([grid_x, grid_y], -1).reshape(-1, 2).to(real.device))
                scores = critic(points).reshape(-1)
                grads = gradient(scores.sum(), points, create_graph=False)
        shape = (self.resolution, self.resolution)
        scores = scores.detach().reshape(shape).cpu().numpy()
        norms = grads.norm(dim=1).reshape(shape).cpu().numpy()
        centre = float(np.median(scores))
        if self.score_half_width is None:
            self.score_half_width = float(np.abs(scores - centre).max()) or 1.0
        fields = {"score": (scores, centre - self.score_half_width,
                            centre + self.score_half_width),
                  "grad_norm": (norms, 0.0, self.max_grad_norm)}
        axes, samples = (xs.numpy(), ys.numpy()), (real.cpu().numpy(), fake.cpu().numpy())
        return {f"{CRITIC_LANDSCAPE}/{kind}": critic_landscape_figure(
                    *axes, field, *samples, kind=kind, vmin=low, vmax=high, title=title)
                for kind, (field, low, high) in fields.items()}


def _extent(samples: Tensor, margin: float = 0.25) -> tuple[float, float, float, float]:
    """The samples' bounding box, grown by ``margin`` of its size on each side."""
    low, high = samples.amin(0), samples.amax(0)
    pad = (high - low).clamp_min(1e-3) * margin
    (x0, y0), (x1, y1) = (low - pad).tolist(), (high + pad).tolist()
    return x0, x1, y0, y1
