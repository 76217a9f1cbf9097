r"""Figures over training: input-gradient saliency maps, a 2D critic's landscape, sample grids.

The first two draw every ``log_every_n_steps`` optimizer steps (or ``every_n_steps``) after the
training batch, with the networks in eval mode, and log a matplotlib figure with ``add_figure``; the
Images tab's slider then plays them over training. Runs with and without a penalty show side by
side there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from matplotlib.figure import Figure
from torch import Tensor, nn

from gradreg import gradient
from gradreg.lightning.callbacks._logging import (
    check_every,
    logging_due,
    logging_step,
    tensorboard,
    warn_without_tensorboard,
)
from gradreg.lightning.callbacks._probe import (
    LossFn,
    cross_entropy_per_sample,
    eval_mode,
    input_gradients,
    split_batch,
)
from gradreg.lightning.dashboards import (
    CRITIC_LANDSCAPE,
    SALIENCY,
    SAMPLES,
    critic_landscape_figure,
    saliency_figure,
)
from gradreg.penalties import as_points


class _FigureLogger(pl.Callback):
    """Draw ``self.draw(pl_module, batch)`` after the training batches that are due."""

    tag: str

    def __init__(self, every_n_steps: int | None) -> None:
        check_every(every_n_steps)
        self.every_n_steps = every_n_steps

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, type(self).__name__, "figures")

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        writer = tensorboard(trainer)
        if writer is None or not logging_due(trainer, self.every_n_steps):
            return
        figure = self.draw(pl_module, batch)
        if figure is not None:
            writer.add_figure(self.tag, figure, logging_step(trainer), close=True)

    def draw(self, pl_module: pl.LightningModule, batch: Any) -> Figure | None:
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
    ``forward``. For several channels the saliency is the largest magnitude over channels.

    Args:
        num_images: how many images to show.
        image_shape: ``(H, W)`` or ``(C, H, W)`` of one input, for flat ``[N, D]`` inputs.
        loss_fn: ``(outputs, targets) -> per-sample losses [B]``; default cross-entropy.
        every_n_steps: drawing interval in optimizer steps; ``None``: ``log_every_n_steps``.
    """

    tag = SALIENCY

    def __init__(
        self,
        num_images: int = 8,
        *,
        image_shape: Sequence[int] | None = None,
        loss_fn: LossFn = cross_entropy_per_sample,
        every_n_steps: int | None = None,
    ) -> None:
        super().__init__(every_n_steps)
        if not isinstance(num_images, int) or num_images < 1:
            raise ValueError(f"num_images must be an int >= 1, got {num_images!r}.")
        self.num_images = num_images
        self.image_shape = None if image_shape is None else tuple(image_shape)
        self.loss_fn = loss_fn
        self.batch: tuple[Tensor, Tensor] | None = None

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

    def draw(self, pl_module: pl.LightningModule, batch: Any) -> Figure | None:
        if self.batch is None:
            return None
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
        return saliency_figure(images.cpu().numpy(), saliency.cpu().numpy(), labels)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.batch is None and tensorboard(trainer) is not None:
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

    Args:
        resolution: grid points per axis.
        extent: ``(xmin, xmax, ymin, ymax)``; ``None``: the first figure's samples plus a margin,
            then fixed so that frames compare.
        every_n_steps: drawing interval in optimizer steps; ``None``: ``log_every_n_steps``.
        seed: seed of the fixed latents.
    """

    tag = CRITIC_LANDSCAPE

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
    ) -> None:
        super().__init__(every_n_steps)
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
        self.latents: Tensor | None = None

    def _attribute(self, pl_module: pl.LightningModule, role: str, kind: type) -> Any:
        name = self.attributes[role]
        value = getattr(pl_module, name, None)
        if not isinstance(value, kind):
            raise ValueError(
                f"CriticLandscape needs pl_module.{name} to be the {role} ({kind.__name__}), "
                f"but {type(pl_module).__name__}.{name} is {type(value).__name__}; name the "
                f"attribute with CriticLandscape({role}='...')."
            )
        return value

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._attribute(pl_module, "critic", nn.Module)
        self._attribute(pl_module, "generator", nn.Module)
        latent_dim = self._attribute(pl_module, "latent_dim", int)
        generator = torch.Generator().manual_seed(self.seed)
        self.latents = torch.randn(self.num_fake, latent_dim, generator=generator)

    def draw(self, pl_module: pl.LightningModule, batch: Any) -> Figure:
        critic = self._attribute(pl_module, "critic", nn.Module)
        generator = self._attribute(pl_module, "generator", nn.Module)
        real = (batch if isinstance(batch, Tensor) else batch[0]).detach()
        if real.ndim != 2 or real.shape[1] != 2:
            raise ValueError(f"CriticLandscape draws 2D data, [N, 2] samples; the batch has shape "
                             f"{list(real.shape)}.")
        with eval_mode(critic, generator):
            with torch.no_grad():
                fake = generator(self.latents.to(real.device, real.dtype))
            if self.extent is None:
                self.extent = _extent(torch.cat([real, fake]))
            xs = torch.linspace(*self.extent[:2], self.resolution, dtype=real.dtype)
            ys = torch.linspace(*self.extent[2:], self.resolution, dtype=real.dtype)
            grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
            with torch.enable_grad():
                points = as_points(torch.stack([grid_x, grid_y], -1).reshape(-1, 2).to(real.device))
                scores = critic(points).reshape(-1)
                grads = gradient(scores.sum(), points, create_graph=False)
        shape = (self.resolution, self.resolution)
        return critic_landscape_figure(
            xs.numpy(), ys.numpy(),
            scores.detach().reshape(shape).cpu().numpy(),
            grads.norm(dim=1).reshape(shape).cpu().numpy(),
            real.cpu().numpy(), fake.cpu().numpy(),
        )


def _extent(samples: Tensor, margin: float = 0.25) -> tuple[float, float, float, float]:
    """The samples' bounding box, grown by ``margin`` of its size on each side."""
    low, high = samples.amin(0), samples.amax(0)
    pad = (high - low).clamp_min(1e-3) * margin
    (x0, y0), (x1, y1) = (low - pad).tolist(), (high + pad).tolist()
    return x0, x1, y0, y1


class SampleGrid(pl.Callback):
    """Images ``G(z)`` of ``num_samples`` latents fixed at fit start (seeded), one grid, tag
    ``samples``, every ``every_n_steps`` optimizer steps (``None``: ``log_every_n_steps``).

    Expects ``pl_module.generator`` (latents ``[N, latent_dim]`` to images ``[N, C, H, W]`` in
    [0, 1]; values outside are clipped) and ``pl_module.latent_dim``, as :class:`~gradreg.
    lightning.gan.GAN` has them. The same latents at every step show the samples evolve.
    """

    def __init__(self, num_samples: int = 64, *, every_n_steps: int | None = None,
                 seed: int = 0) -> None:
        check_every(every_n_steps)
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}.")
        self.num_samples, self.every_n_steps, self.seed = num_samples, every_n_steps, seed
        self.latents: Tensor | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "SampleGrid", "sample grids")
        generator = torch.Generator().manual_seed(self.seed)
        self.latents = torch.randn(self.num_samples, pl_module.latent_dim, generator=generator)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        writer = tensorboard(trainer)
        if writer is None or not logging_due(trainer, self.every_n_steps):
            return
        with eval_mode(pl_module.generator), torch.no_grad():
            images = pl_module.generator(self.latents.to(pl_module.device))
        if images.ndim != 4:
            raise ValueError(f"SampleGrid shows images, [N, C, H, W]; the generator made shape "
                             f"{list(images.shape)}.")
        writer.add_images(SAMPLES, images.clamp(0, 1).float().cpu(), logging_step(trainer))
