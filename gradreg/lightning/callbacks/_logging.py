"""Where and when the callbacks write: Lightning's logging cadence and step, TensorBoard's writer.

The cadence and the step are those of Lightning's own monitors (``LearningRateMonitor``,
``DeviceStatsMonitor``): every ``log_every_n_steps`` optimizer steps, at the step that the
module's ``self.log`` scalars get, so every chart of a run shares one x-axis. They read the same
two trainer internals those monitors read, through :mod:`gradreg.lightning.compat`.
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.tensorboard import SummaryWriter

from gradreg.lightning.compat import accumulating, batches_that_stepped


def check_every(every_n_steps: int | None) -> None:
    """``every_n_steps`` is ``None`` (the Trainer's ``log_every_n_steps``) or an int >= 1."""
    if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
        raise ValueError(
            f"every_n_steps must be an int >= 1, or None to follow the Trainer's "
            f"log_every_n_steps; got {every_n_steps!r}."
        )


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs the current batch's metrics at (optimizer steps taken before it)."""
    return batches_that_stepped(trainer)


def logging_due(trainer: pl.Trainer, every_n_steps: int | None = None) -> bool:
    """Whether this batch is logged: Lightning's rule, with ``every_n_steps`` for the interval.

    Due when ``(logging_step + 1) % n == 0`` (``n`` the Trainer's ``log_every_n_steps`` unless
    given) or training is about to stop, never on a micro-batch that only accumulates.
    """
    n = trainer.log_every_n_steps if every_n_steps is None else every_n_steps
    if n == 0:
        return False
    if trainer.lightning_module.automatic_optimization and accumulating(trainer):
        return False
    return (logging_step(trainer) + 1) % n == 0 or trainer.should_stop


def log_scalars(trainer: pl.Trainer, scalars: Mapping[str, float]) -> None:
    """Write ``scalars`` to every logger of the trainer at :func:`logging_step`."""
    values = {tag: float(value) for tag, value in scalars.items()}
    for logger in trainer.loggers:
        logger.log_metrics(values, step=logging_step(trainer))


def tensorboard(trainer: pl.Trainer) -> SummaryWriter | None:
    """The ``SummaryWriter`` of the trainer's first ``TensorBoardLogger``, if it has one."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def warn_without_tensorboard(trainer: pl.Trainer, who: str, what: str) -> None:
    """Warn once per fit that ``who`` cannot write ``what`` because TensorBoard is not logging."""
    if tensorboard(trainer) is None:
        rank_zero_warn(
            f"{who} writes {what} to TensorBoard, but the Trainer has no TensorBoardLogger, so "
            "they are not logged. Pass logger=TensorBoardLogger(save_dir) to the Trainer."
        )
