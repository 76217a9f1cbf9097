"""Checkpoints for exact resume: atomic writes, and the random state in the checkpoint.

A run killed after a checkpoint and resumed from it with ``trainer.fit(..., ckpt_path=...)``
continues exactly as the uninterrupted run (same parameters, buffers, metrics) when

* the module's state is all in ``state_dict``: gradreg's penalties keep their lazy counter and
  path-length mean as buffers and their weight as extra state; a schedule callback keeps its own;
* the random state is restored too (:class:`RandomState`; Lightning restores no RNG by itself):
  interpolation coefficients, DRAGAN and path-length noise, latents and the shuffling of the next
  epoch all come from the global generators;
* the checkpoint was taken at an epoch boundary, or the data loader is stateful: a plain
  ``DataLoader`` restarts its epoch from the first batch on resume.

:class:`AtomicCheckpointIO` makes sure a checkpoint on disk is always a complete one, and that a
save that fails (a full disk) says which file in one message (:class:`CheckpointSaveError`).
:class:`PreemptionCheckpoint` saves the run when a cluster preempts it (``SIGTERM``) or on Ctrl-C
(``SIGINT``).
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from gradreg.lightning.compat import note_sigterm

__all__ = ["AtomicCheckpointIO", "CheckpointSaveError", "PreemptionCheckpoint", "RandomState"]


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (``errno`` and ``strerror`` those of the failure, e.g.
    ENOSPC); the file at ``filename`` is the previous checkpoint, intact, or absent."""

    def __str__(self) -> str:
        return (f"could not save the checkpoint {self.filename} ({self.strerror}); the previous "
                "checkpoint there, if any, is intact: free space or choose another "
                "paths.output_dir, then resume from the last complete checkpoint")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose save is all-or-nothing on a local file system.

    The checkpoint is serialized into a temporary file in the destination's directory, flushed to
    disk (``fsync``) and renamed over the destination with ``os.replace``, which POSIX makes
    atomic within one file system. A process killed at any point of a save leaves the previous
    checkpoint at ``path`` intact (at worst a stray ``.*.tmp`` file, which no checkpoint pattern
    matches); a save that raises removes its temporary file, and an ``OSError`` (a full disk:
    ENOSPC) is raised as a :class:`CheckpointSaveError` naming ``path``. Use it as
    ``Trainer(plugins=[AtomicCheckpointIO()])``. The file gets the mode a plain ``open()`` would
    give it (0666 less the umask), not the temporary file's 0600. (Lightning's own save writes
    through an ``fsspec`` transaction whose temporary file lives in the system temp dir; across
    file systems its final move is a copy, and nothing is fsynced.)
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint takes no storage_options, got "
                f"{storage_options!r}."
            )
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                                 dir=path.parent)
        try:
            os.chmod(temporary, 0o666 & ~_umask())  # mkstemp's 0600 -> what open() would give
            with os.fdopen(descriptor, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except OSError as error:
            Path(temporary).unlink(missing_ok=True)
            raise CheckpointSaveError(error.errno, error.strerror or str(error), str(path)
                                      ) from error
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        _fsync_directory(path.parent)


def _umask() -> int:
    """The process's file mode creation mask (reading it means setting it: set it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX: the directory entry lives in the directory)."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class RandomState(pl.Callback):
    """Save the global random state (python, numpy, torch CPU and CUDA) in every checkpoint and
    restore it on resume, so that the random draws after a resume are those of the uninterrupted
    run.

    Each process saves and restores its own state, but only rank 0 writes the checkpoint: under
    DDP every rank resumes with rank 0's state. That is exact for gradreg's modules when all ranks
    are seeded alike (``seed_everything(s)`` without ``workers``-rank offsets) and draw per-sample
    noise for their own samples only; the state of other ranks is not kept.
    """

    def state_dict(self) -> dict[str, Any]:
        # numpy's state as plain values: checkpoints stay loadable with torch.load(weights_only)
        name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
        state = {
            "python": random.getstate(),
            "numpy": (name, keys.tolist(), position, has_gauss, cached_gaussian),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.setstate(state_dict["python"])
        name, keys, position, has_gauss, cached_gaussian = state_dict["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss,
                             cached_gaussian))
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])


class PreemptionCheckpoint(pl.Callback):
    """Stop training within one step of a ``SIGTERM`` (a cluster's preemption) or a ``SIGINT``
    (Ctrl-C), save a resumable checkpoint at ``path`` and remember it in :attr:`saved`, and the
    signal in :attr:`stopped_by`.

    A second Ctrl-C before the step ends raises ``KeyboardInterrupt`` at once (Lightning's own
    shutdown, nothing saved); so does a Ctrl-C outside training (setup, test), which
    :attr:`stopped_by` records too (:meth:`on_exception`).

    Lightning's own handling stops a single process only at the end of the epoch, and its
    handler starts a broadcast inside the signal handler, which aborts DDP ranks caught in
    another collective. From the start of training this replaces it with a handler that only
    records the signal and passes it on to the ranks the launcher started. At the end of each
    training batch the ranks agree on it (a maximum over the ranks of whether each received
    it, one all-reduce per step under DDP) before Lightning sees it
    (:func:`~gradreg.lightning.compat.note_sigterm`), so every rank stops after the same batch.
    Noted on one rank alone, Lightning's flag stops that rank after its batch while another,
    a step ahead, waits in the next step's broadcast: the ranks wait for each other forever
    (a checkpoint's barrier against a broadcast). On every rank, before the trainer tears
    down, the state of that step (parameters, optimizer, loops, callbacks such as
    :class:`RandomState`) is saved with ``trainer.save_checkpoint``, which writes from rank 0 only.
    Resumed from it, a run continues from the step it reached; the interrupted epoch's remaining
    steps take a new pass of a plain ``DataLoader`` (not the batches the uninterrupted run would
    have taken, see module docstring). A signal outside ``fit`` (in ``test``) saves nothing:
    training has ended. A ``SIGINT`` is not passed on to the launcher's ranks (a terminal's
    Ctrl-C reaches them all; the ranks agree on one that reached only some).
    """

    #: the signals that stop training after the current step and save it
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.saved: Path | None = None
        #: the signal that stopped the run (SIGTERM or SIGINT), None while it runs
        self.stopped_by: signal.Signals | None = None
        self._received = False  # a signal reached this process, not yet agreed by the ranks

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there (as Lightning's own)

        def noted(signum: int, frame: FrameType | None) -> None:
            if signum == signal.SIGINT and self.stopped_by == signal.SIGINT:
                raise KeyboardInterrupt  # Ctrl-C twice: stop now
            if (not self._received and signum == signal.SIGTERM
                    and trainer.strategy.launcher is not None):
                trainer.strategy.launcher.kill(signum)
            self.stopped_by = self.stopped_by or signal.Signals(signum)
            self._received = True

        for signum in self.SIGNALS:
            signal.signal(signum, noted)  # Lightning restores the originals at teardown
            # restart system calls the signal interrupts: a DDP rank caught inside a collective
            # (the step's broadcast of rank 0's flag) would otherwise see it fail, take the flag
            # as 0 and go on one step out of step with the others, which then wait for it forever
            signal.siginterrupt(signum, False)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._agreed(trainer) and trainer.world_size == 1:
            raise SIGTERMException

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._agreed(trainer)  # a signal during the epoch's validation: Lightning stops here

    def _agreed(self, trainer: pl.Trainer) -> bool:
        """Whether any rank received the signal, asked of every rank at the same point (the
        end of a batch or an epoch: one all-reduce under DDP); where one did, Lightning's flag
        is set on every rank, which stops them all at the same step."""
        received = self._received
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            flag = torch.tensor([int(received)], device=trainer.strategy.root_device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            received = bool(flag.item())
        if received:
            note_sigterm(trainer)
        return received

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt):  # a Ctrl-C our handler did not turn
            self.stopped_by = self.stopped_by or signal.SIGINT  # into a stop after the step
        elif isinstance(exception, SIGTERMException) and trainer.state.fn == TrainerFn.FITTING:
            trainer.save_checkpoint(self.path, weights_only=False)
            self.saved = self.path
