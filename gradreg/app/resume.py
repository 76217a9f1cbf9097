"""Resuming a run: the checkpoint it resumes from (one of its own model and penalties), the
folder a fresh run may write to, what a preempted run says, and which penalty weights apply when
the command line and the checkpoint differ.

A checkpoint restores each penalty's weight (its extra state). On resume, a weight given on the
command line (``penalty.weight=5``, ``penalties.<name>.weight=...``) replaces the checkpoint's;
a weight that only the config files set does not (the checkpoint's run may have been started
with an override that the resume command does not repeat). Either way a line says which value
applies where the two differ. A ``PenaltyWeightSchedule`` still sets the weights every step.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NoReturn

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from gradreg.lightning.checkpoint import PreemptionCheckpoint
from gradreg.lightning.penalized import checkpoint_mismatch

from .checks.errors import ConfigError
from .checks.paths import resolve_checkpoint
from .console import say
from .invocation import command

#: the exit status of a run stopped by a signal: 128 + its number, what a shell reports for it
#: (SIGTERM 143, SIGINT 130)
SIGNAL_STATUS = 128
#: what a run leaves in its folder: a fresh run refuses a folder that holds any of them
RUN_RESULTS = ("checkpoints/*.ckpt", "metrics.json")


def weight_overrides(overrides: Iterable[str], penalty_name: str) -> set[str]:
    """The penalties (by their key in the model) whose weight the command line sets:
    ``penalty.weight=...`` is the selected preset ``penalty_name``,
    ``penalties.<name>.weight=...`` is ``<name>``."""
    keys = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "penalty.weight":
            keys.add(penalty_name)
        elif key.startswith("penalties.") and key.endswith(".weight") and key.count(".") == 2:
            keys.add(key.split(".")[1])
    return keys


class ResumedWeights(pl.Callback):
    """After the checkpoint is restored (``on_train_start``), give each penalty in ``explicit``
    its configured weight, and report every penalty whose weight differs from the config's."""

    def __init__(self, configured: Mapping[str, float], explicit: set[str]) -> None:
        self.configured, self.explicit = dict(configured), set(explicit)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, weight in self.configured.items():
            penalty = pl_module.penalties[name]
            if penalty.weight == weight:
                continue
            if name in self.explicit:
                if trainer.is_global_zero:
                    say(f"resume: penalty {name!r} weight {weight} from the command line "
                        f"(the checkpoint had {penalty.weight})")
                penalty.weight = weight
            elif trainer.is_global_zero:
                say(f"resume: penalty {name!r} weight {penalty.weight} from the checkpoint "
                    f"(the config says {weight}; set it on the command line to change it)")


def check_fresh_output(output_dir: Path, resuming: bool) -> None:
    """Raise ConfigError if ``output_dir`` holds another run's results (checkpoints,
    metrics.json) and this run does not resume (``ckpt_path``): its checkpoints would mix with
    the other run's and ``ckpt_path=<folder>`` would later resume the wrong one. Checked on the
    first process only (the other DDP ranks re-run the script in rank 0's folder)."""
    if resuming or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    found = sorted({pattern.split("/")[0] for pattern in RUN_RESULTS if any(
        output_dir.glob(pattern))})
    if found:
        raise ConfigError(
            f"paths.output_dir: {str(output_dir)!r} holds another run's results "
            f"({', '.join(found)}); every run writes to a folder of its own: leave "
            "paths.output_dir unset (a new folder under paths.runs), choose a new folder, or "
            f"continue that run with ckpt_path={output_dir}")


def checkpoint_of(model: nn.Module, path: Path | None, last: bool, runs_root: Path,
                  output_dir: Path) -> Path | None:
    """The checkpoint ``model`` resumes from: ``path`` (resolved by ``resolve_checkpoint``; None:
    a fresh run), checked to be of the model's module and penalties
    (:func:`~gradreg.lightning.penalized.checkpoint_mismatch`).

    ``last`` (``ckpt_path=last``, ``path`` the newest ``checkpoints/last.ckpt`` under
    ``runs_root``): the newest of those, other than the current run's (``output_dir``), of the
    same module and penalties; the checkpoints of other experiments are passed over, and where
    every one is of another model the error names the newest."""
    if path is None:
        return None
    if not last:
        mismatch = checkpoint_mismatch(_load(path), model)
        if mismatch is not None:
            raise ConfigError(f"ckpt_path: {str(path)!r} is {mismatch}: resume with the model "
                              "and penalties of that run, or train without ckpt_path")
        return path
    candidates = sorted((p for p in runs_root.glob("**/checkpoints/last.ckpt")
                         if output_dir.resolve() not in p.resolve().parents),
                        key=lambda p: p.stat().st_mtime, reverse=True)
    mismatches = []
    for candidate in candidates:
        candidate = resolve_checkpoint(str(candidate), runs_root, output_dir)
        mismatch = checkpoint_mismatch(_load(candidate), model)
        if mismatch is None:
            return candidate
        mismatches.append((candidate, mismatch))
    newest, mismatch = mismatches[0]
    raise ConfigError(
        f"ckpt_path: 'last' resumes the newest run of this model and penalties, and none of the "
        f"{len(candidates)} checkpoints/last.ckpt under {str(runs_root)!r} is one (the newest, "
        f"{str(newest)!r}, is {mismatch}); pass the checkpoint to resume, with the model and "
        "penalties of its run")


def _load(path: Path) -> dict:
    """A checkpoint's contents, its tensors mapped from the file rather than read."""
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


def resume_command(overrides: Iterable[str], checkpoint: Path) -> str:
    """The command line that continues a run started with ``overrides`` from ``checkpoint``."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "ckpt_path"]
    return shlex.join([*command(), *kept, f"ckpt_path={checkpoint}"])


def stopped_by(trainer: pl.Trainer | None) -> signal.Signals | None:
    """The signal (SIGTERM, SIGINT) that stopped ``trainer``'s run, as its
    :class:`~gradreg.lightning.checkpoint.PreemptionCheckpoint` recorded it; None where none
    did, or without that callback."""
    callbacks = [] if trainer is None else trainer.callbacks
    return next((c.stopped_by for c in callbacks
                 if isinstance(c, PreemptionCheckpoint) and c.stopped_by), None)


def exit_stopped(trainer: pl.Trainer | None, overrides: Iterable[str],
                 signum: signal.Signals = signal.SIGTERM) -> NoReturn:
    """End a run stopped by a signal (``SIGTERM``, Ctrl-C's ``SIGINT``; the one that
    :func:`stopped_by` names, else ``signum``) with status 128 + its number and one line on
    stderr (from rank 0): the checkpoint to resume from (the one saved when the signal came, else
    the run's ``last.ckpt``) and the command that resumes from it. ``trainer`` None: stopped
    before there was a trainer, nothing saved."""
    signum = stopped_by(trainer) or signum
    saved = next((c.saved for c in trainer.callbacks
                  if isinstance(c, PreemptionCheckpoint) and c.saved), None) if trainer else None
    if saved is None and trainer is not None:  # stopped outside training's steps
        checkpoint = trainer.checkpoint_callback
        last = isinstance(checkpoint, ModelCheckpoint) and checkpoint.last_model_path
        saved = Path(last) if last and Path(last).is_file() else None
    if trainer is None or trainer.is_global_zero:
        where = (f"saved {saved}; resume with: {resume_command(overrides, saved)}" if saved
                 else "no checkpoint was saved")
        when = ("before training" if trainer is None else
                f"at epoch {trainer.current_epoch} step {trainer.global_step}")
        name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signum.name
        say(f"error: stopped by {name} {when}: {where}", sys.stderr)
    sys.exit(SIGNAL_STATUS + signum)
