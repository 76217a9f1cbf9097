"""Write the custom-scalars layout once, so TensorBoard shows loss, penalties and norms together."""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl

from gradreg.lightning.callbacks._logging import tensorboard, warn_without_tensorboard
from gradreg.lightning.dashboards import custom_scalars_layout


class CustomScalarsLayout(pl.Callback):
    """At fit start, ``add_custom_scalars(layout)``; see :func:`.dashboards.custom_scalars_layout`.

    Args:
        loss: regexes of the module's task-loss tags (matched from the tag's start).
    """

    def __init__(self, loss: Sequence[str] = (r".*loss.*",)) -> None:
        if isinstance(loss, str):
            raise ValueError(f"loss must be a list of regexes, got the string {loss!r}; "
                             f"write loss=[{loss!r}].")
        self.layout = custom_scalars_layout(loss)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "CustomScalarsLayout", "the layout")
        writer = tensorboard(trainer)
        if writer is not None:
            writer.add_custom_scalars(self.layout)
