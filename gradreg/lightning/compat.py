"""Every name of Lightning's (and torch's ``SummaryWriter``'s) that is not public API, in one
place.

Neither exports a public name for these; each is pinned by ``tests/lightning/test_compat.py``,
which fails with the name and this module when a Lightning release moves it.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.writer import FileWriter

__all__ = ["accumulating", "attached_trainer", "batches_that_stepped",
           "data_parallel_over_all_ranks", "event_file_writer", "note_sigterm",
           "relaunches_script"]


def relaunches_script(trainer: pl.Trainer) -> bool:
    """Whether the trainer's strategy starts its extra ranks by re-running the command line
    (``strategy="ddp"`` on CPUs or GPUs), rather than as processes of this one (``ddp_spawn``)."""
    return isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)


def note_sigterm(trainer: pl.Trainer) -> None:
    """Mark ``trainer`` as having received ``SIGTERM`` (``trainer.received_sigterm``), as
    Lightning's own handler does, but without the broadcast that handler starts: a collective
    begun inside a signal handler interleaves with the one in flight (a checkpoint's barrier) and
    the DDP ranks abort (measured on Lightning 2.6.6, gloo). Lightning's per-step broadcast of the
    flag from rank 0 then stops every rank at the same step."""
    trainer._signal_connector.received_sigterm = True


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The optimizer steps taken before the current batch, counted once per batch that stepped
    (the step Lightning logs ``self.log`` scalars at; ``trainer.global_step`` counts every
    optimizer's steps, twice per batch in a GAN)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def accumulating(trainer: pl.Trainer) -> bool:
    """Whether the current batch only accumulates gradients (``accumulate_grad_batches`` > 1 and
    the optimizer does not step after it)."""
    return trainer.fit_loop._should_accumulate()


def event_file_writer(writer: SummaryWriter) -> FileWriter:
    """The writer's event file, for summaries it has no ``add_*`` method for (the HParams
    plugin's); reopened if the writer was closed (Lightning closes it at the end of fit)."""
    return writer._get_file_writer()


def attached_trainer(module: pl.LightningModule) -> pl.Trainer | None:
    """The trainer ``module`` is attached to, or None (``module.trainer`` raises when there is
    none: a module called outside ``Trainer.fit``)."""
    return module._trainer


def data_parallel_over_all_ranks(strategy: ModelParallelStrategy) -> None:
    """Where ``strategy``'s data-parallel size was left ``"auto"`` (which Lightning resolves to
    the number of nodes), make it every rank: ``num_nodes * num_processes``. Call before its
    ``setup_environment`` builds the device mesh."""
    if strategy._data_parallel_size == "auto":
        strategy._data_parallel_size = strategy.num_nodes * strategy.num_processes
