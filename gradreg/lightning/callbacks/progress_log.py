"""Progress as lines of text, for runs whose output goes to a file (CI, SLURM, ``nohup``, ``>``).

A progress bar redraws one line in a terminal; written to a file it is thousands of lines, so the
app draws none there (``trainer.enable_progress_bar`` follows ``sys.stdout.isatty()``), and a long
run would say nothing until it ends. :class:`ProgressLog` fills that gap with one line every
``every_n_batches`` training batches or ``every_seconds`` seconds, whichever comes first::

    epoch 3  batch 12/20  step 72  train/loss 0.4121  train/penalty/double_backprop 0.0056  5.1 it/s

plus one line at the last batch of each training epoch, and one after each validation and test
with their metrics.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Mapping

import lightning.pytorch as pl
from torch import Tensor

log = logging.getLogger(__name__)


class ProgressLog(pl.Callback):
    """One line of progress every ``every_n_batches`` training batches or ``every_seconds``
    seconds, whichever comes first, one at the last batch of each training epoch, and one after
    each validation (not the sanity check) and test; from global rank 0 only.

    A line holds the epoch, the batch within it (of ``trainer.num_training_batches``), the
    optimizer steps taken (Lightning's ``global_step``), the latest value of every metric the
    module logged whose name starts with one of ``prefixes`` (``callback_metrics``), and the
    training batches per second since the previous line (``it/s``, as a progress bar counts
    them). Reading the metrics is one host read per line, none on the batches between lines;
    the per-batch cost is a counter and a clock read.

    The lines go to this module's logger (``logging``), so an app that configures logging puts
    them where its other records go: under Hydra, the console and the run folder's log file
    (``train.log`` of the app). Where no handler would receive them (logging not
    configured), they are printed to stdout.

    Args:
        every_n_batches: a line after this many training batches (None: by time only).
        every_seconds: a line once this many seconds have passed since the previous one (None:
            by batches only).
        enabled: True: always; False: never; None: only where ``sys.stdout`` is not a terminal
            (the progress bar's rule in the app, so that exactly one of the two reports).
        prefixes: the metric names shown in the batch lines (validation and test lines show
            ``val/`` and ``test/`` metrics).
    """

    def __init__(self, every_n_batches: int | None = 100, every_seconds: float | None = 30.0,
                 enabled: bool | None = None, prefixes: tuple[str, ...] = ("train/",)) -> None:
        if every_n_batches is not None and (isinstance(every_n_batches, bool)
                                            or not isinstance(every_n_batches, int)
                                            or every_n_batches < 1):
            raise ValueError(
                f"every_n_batches must be an int >= 1 or None; got {every_n_batches!r}.")
        if every_seconds is not None and (isinstance(every_seconds, bool)
                                          or not isinstance(every_seconds, int | float)
                                          or not math.isfinite(every_seconds)
                                          or every_seconds <= 0):
            raise ValueError(f"every_seconds must be a number > 0 or None; got {every_seconds!r}.")
        if isinstance(prefixes, str):
            raise ValueError(f"prefixes must be a list of strings, got the string {prefixes!r}; "
                             f"write prefixes=[{prefixes!r}].")
        self.every_n_batches = every_n_batches
        self.every_seconds = every_seconds
        self.enabled = enabled
        self.prefixes = tuple(prefixes)
        self._active = False  # set for each trainer at setup
        self._batches = 0  # since the previous line
        self._since = 0.0  # time.monotonic() of the previous line (moved on by validations)
        self._batch = 0  # the latest training batch's number in its epoch
        self._validation_start = 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        on = not sys.stdout.isatty() if self.enabled is None else self.enabled
        self._active = on and trainer.is_global_zero

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batches, self._since = 0, time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: object, batch: object, batch_idx: int) -> None:
        if not self._active:
            return
        self._batches += 1
        self._batch = batch_idx + 1
        due = (self.every_n_batches is not None and self._batches >= self.every_n_batches) or (
            self.every_seconds is not None
            and time.monotonic() - self._since >= self.every_seconds)
        if due or self._batch == trainer.num_training_batches:  # the epoch's last batch too
            self._line(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and self._batches:  # an epoch of unknown length
            self._line(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_start = time.monotonic()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._since += time.monotonic() - self._validation_start  # it/s counts training only
        if self._active and not trainer.sanity_checking:
            write(f"epoch {trainer.current_epoch}  validation",
                  metrics(trainer.callback_metrics, ("val/",)))

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            write("test", metrics(trainer.callback_metrics, ("test/",)))

    def _line(self, trainer: pl.Trainer) -> None:
        now = time.monotonic()
        rate = self._batches / max(now - self._since, 1e-9)
        self._batches, self._since = 0, now
        total = trainer.num_training_batches
        of = f"/{total}" if math.isfinite(total) else ""
        write(f"epoch {trainer.current_epoch}  batch {self._batch}{of}  "
              f"step {trainer.global_step}",
              metrics(trainer.callback_metrics, self.prefixes), f"{rate:.3g} it/s")


def write(*parts: str) -> None:
    """One line of the non-empty ``parts``: to this module's logger, or printed where no
    handler would receive it."""
    line = "  ".join(part for part in parts if part)
    if log.hasHandlers():
        log.info(line)
    else:
        print(line, flush=True)


def metrics(values: Mapping[str, Tensor | float], prefixes: tuple[str, ...]) -> str:
    """``name value`` for every metric whose name starts with one of ``prefixes``, sorted by
    name, 4 significant digits."""
    return "  ".join(f"{name} {float(value):.4g}" for name, value in sorted(values.items())
                     if name.startswith(prefixes))
