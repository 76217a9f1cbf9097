"""One GAN training run for the resume test; ``python resume_run.py DIR`` is the run that gets
killed (exit status 17 in the middle of epoch 3, after the epoch-2 checkpoint is on disk)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_cases import QUIET, gan, toy
from torch.utils.data import DataLoader

from gradreg.lightning.callbacks import PenaltyWeightSchedule
from gradreg.lightning.checkpoint import AtomicCheckpointIO, RandomState

EPOCHS, KILL_EPOCH, KILL_BATCH = 4, 2, 1  # epochs 0-based: the last checkpoint is epoch=1
PENALTIES = {
    "gp": {"name": "wgan_gp"},
    "r1": {"name": "r1", "weight": 1.0, "every": 2},
    "pl": {"name": "path_length", "weight": 0.1},
}


class KillAt(Callback):
    """Hard exit (no cleanup, no final checkpoint) after training batch ``batch`` of ``epoch``."""

    def __init__(self, epoch: int, batch: int) -> None:
        self.epoch, self.batch = epoch, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            os._exit(17)


def fit(directory: Path, *, ckpt_path: Path | None = None, kill: bool = False,
        random_state: bool = True) -> tuple[L.LightningModule, dict[str, float]]:
    L.seed_everything(0)
    model = gan(**PENALTIES)
    callbacks = [
        PenaltyWeightSchedule("linear", start=0.0, end=10.0, steps=20, penalties=["penalties.gp"]),
        ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1),
        *([RandomState()] if random_state else []),
        *([KillAt(KILL_EPOCH, KILL_BATCH)] if kill else []),
    ]
    trainer = L.Trainer(**QUIET, max_epochs=EPOCHS, callbacks=callbacks,
                        plugins=[AtomicCheckpointIO()], default_root_dir=directory)
    train = DataLoader(toy("8gaussians", 96), batch_size=16, shuffle=True)
    val = DataLoader(toy("8gaussians", 64, seed=1), batch_size=64)
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    return model, {k: float(v) for k, v in trainer.callback_metrics.items()}



if __name__ == "__main__":
    torch.set_num_threads(1)
    fit(Path(sys.argv[1]), kill=True)
