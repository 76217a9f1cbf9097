"""Lightning's private names that gradreg uses, pinned: a Lightning release that moves one fails
here, naming it and gradreg.lightning.compat, the one module to change."""

from __future__ import annotations

import importlib

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter

from gradreg.lightning.compat import (
    accumulating,
    attached_trainer,
    batches_that_stepped,
    event_file_writer,
    note_sigterm,
    relaunches_script,
)

PRIVATE_NAMES = [("lightning.pytorch.strategies.launchers.subprocess_script",
                  "_SubprocessScriptLauncher")]


def test_a_summary_writer_hands_out_its_event_file_also_after_close(tmp_path) -> None:
    writer = SummaryWriter(tmp_path)
    assert event_file_writer(writer) is writer.file_writer
    writer.close()
    reopened = event_file_writer(writer)
    assert reopened is writer.file_writer and reopened.get_logdir() == str(tmp_path)
    writer.close()


@pytest.mark.parametrize(("module", "name"), PRIVATE_NAMES)
def test_the_private_names_still_exist(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), (
        f"Lightning {pl.__version__} has no {module}.{name}: update gradreg/lightning/compat.py")


def test_a_module_outside_a_trainer_has_no_attached_trainer() -> None:
    module = pl.LightningModule()
    assert "_trainer" in vars(module), (
        f"Lightning {pl.__version__} keeps no LightningModule._trainer: update "
        "gradreg/lightning/compat.py")
    assert attached_trainer(module) is None


def test_a_noted_sigterm_is_the_trainers_received_sigterm() -> None:
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    assert trainer.received_sigterm is False
    note_sigterm(trainer)
    assert trainer.received_sigterm is True, (
        f"Lightning {pl.__version__} keeps received_sigterm elsewhere: update "
        "gradreg/lightning/compat.py")


@pytest.mark.parametrize(("strategy", "relaunches"), [("ddp", True), ("ddp_spawn", False)])
def test_which_strategies_relaunch_the_script(strategy: str, relaunches: bool) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False,
                         enable_checkpointing=False)
    assert relaunches_script(trainer) is relaunches


class OneStep(pl.LightningModule):
    """A linear model; with ``optimizers=2`` it steps two optimizers by hand per batch (as a GAN
    does), else Lightning steps its one optimizer."""

    def __init__(self, optimizers: int = 1) -> None:
        super().__init__()
        self.automatic_optimization = optimizers == 1
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 1) for _ in range(optimizers))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor | None:
        if self.automatic_optimization:
            return self.layers[0](batch[0]).sum()
        for optimizer, layer in zip(self.optimizers(), self.layers, strict=True):
            optimizer.zero_grad()
            self.manual_backward(layer(batch[0]).sum())
            optimizer.step()
        return None

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(layer.parameters(), lr=0.0) for layer in self.layers]


class AtBatchEnd(pl.Callback):
    """Records (batches_that_stepped, accumulating, global_step) at every batch's end."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, bool, int]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.seen.append((batches_that_stepped(trainer), accumulating(trainer),
                          trainer.global_step))


def batch_ends(optimizers: int, accumulate: int, batches: int) -> list[tuple[int, bool, int]]:
    record = AtBatchEnd()
    pl.Trainer(max_epochs=1, accumulate_grad_batches=accumulate, logger=False,
               enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[record]).fit(
        OneStep(optimizers), DataLoader(TensorDataset(torch.ones(batches, 2)), batch_size=1))
    return record.seen


def test_batches_that_stepped_and_accumulating_follow_the_optimizer_steps() -> None:
    """5 batches, 2 accumulated per step: steps after batches 2, 4 and 5 (the last batch always
    steps); at a batch's end the count is of the steps before it."""
    assert batch_ends(optimizers=1, accumulate=2, batches=5) == [
        (0, True, 0), (0, False, 1), (1, True, 1), (1, False, 2), (2, False, 3)], (
        f"Lightning {pl.__version__} moved fit_loop.epoch_loop._batches_that_stepped or "
        "fit_loop._should_accumulate: update gradreg/lightning/compat.py")


def test_batches_that_stepped_counts_a_batch_once_where_global_step_counts_each_optimizer() -> (
        None):
    """Two optimizers stepped by hand per batch: global_step 2 per batch, the logging step 1."""
    assert batch_ends(optimizers=2, accumulate=1, batches=3) == [
        (0, False, 2), (1, False, 4), (2, False, 6)], (
        f"Lightning {pl.__version__} counts fit_loop.epoch_loop._batches_that_stepped "
        "differently: update gradreg/lightning/compat.py")
