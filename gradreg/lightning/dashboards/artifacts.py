"""A dashboard figure to every logger of a trainer that keeps images: TensorBoard's Images tab,
an MLflow run's artifacts (``figures/<tag>/step_<step>.png``), a W&B run's media (the image
under its tag, at its step) and a CSV logger's folder (``figures/<tag>/step_<step>.png`` next
to its ``metrics.csv``)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import (
    CSVLogger,
    Logger,
    MLFlowLogger,
    TensorBoardLogger,
    WandbLogger,
)
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: the loggers that keep figures
FIGURE_LOGGERS = (TensorBoardLogger, MLFlowLogger, WandbLogger, CSVLogger)


def keeps_figures(trainer: pl.Trainer) -> bool:
    """Whether one of the trainer's loggers keeps figures (:data:`FIGURE_LOGGERS`)."""
    return any(isinstance(logger, FIGURE_LOGGERS) for logger in trainer.loggers)


def figure_path(tag: str, step: int) -> str:
    """``figures/saliency/step_000120.png``: where a file-keeping logger puts a figure."""
    return f"figures/{tag}/step_{step:06d}.png"


def rgb(figure: Figure) -> np.ndarray:
    """The figure rendered (Agg) as an ``[H, W, 3]`` uint8 array."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def log_figure(trainer: pl.Trainer, tag: str, figure: Figure, step: int) -> None:
    """``figure`` under ``tag`` at ``step`` to each logger of the trainer that keeps figures,
    on global rank 0 (the loggers of the other ranks write nothing)."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        _log(logger, tag, figure, step)


def _log(logger: Logger, tag: str, figure: Figure, step: int) -> None:
    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_figure(tag, figure, step, close=False)
    elif isinstance(logger, MLFlowLogger):
        logger.experiment.log_figure(logger.run_id, figure, figure_path(tag, step))
    elif isinstance(logger, WandbLogger):
        logger.log_image(key=tag, images=[rgb(figure)], step=step)
    elif isinstance(logger, CSVLogger):
        path = Path(logger.log_dir) / figure_path(tag, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path)
