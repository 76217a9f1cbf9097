"""Write the custom-scalars layout once, so TensorBoard shows loss, penalties and norms together."""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl

from gradreg.lightning.callbacks._logging import tensorboard, warn_without_tensorboard
from gradreg.lightning.dashboards import CHARTS, TASK_LOSS, custom_scalars_layout


class CustomScalarsLayout(pl.Callback):
    """At fit start, ``add_custom_scalars`` of :func:`.dashboards.custom_scalars_layout`: the task
    loss chart and the charts the trainer's other callbacks feed (their ``charts`` attribute:
    :class:`GradientNormMonitor` the losses, penalties and norms, :class:`InterpolatesGradientNorm`
    the critic's gradient norm), so that no chart stays empty.

    Args:
        loss: regexes of the module's training task-loss tags (matched from the tag's start); the
            default matches gradreg's classifier and GAN, so that runs of both in one log folder
            share one layout.
    """

    def __init__(self, loss: Sequence[str] = TASK_LOSS) -> None:
        if isinstance(loss, str):
            raise ValueError(f"loss must be a list of regexes, got the string {loss!r}; "
                             f"write loss=[{loss!r}].")
        self.loss = tuple(loss)
        self.layout: dict[str, dict[str, list]] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "CustomScalarsLayout", "the layout")
        fed = {chart for callback in trainer.callbacks
               for chart in getattr(callback, "charts", ()) if chart in CHARTS}
        self.layout = custom_scalars_layout(self.loss, {"task_loss", *fed})
        writer = tensorboard(trainer)
        if writer is not None:
            writer.add_custom_scalars(self.layout)
