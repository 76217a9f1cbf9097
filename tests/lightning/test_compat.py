"""Lightning's private names that gradreg uses, pinned: a Lightning release that moves one fails
here, naming it and gradreg.lightning.compat, the one module to change."""

from __future__ import annotations

import importlib

import lightning.pytorch as pl
import pytest
from torch.utils.tensorboard import SummaryWriter

from gradreg.lightning.compat import attached_trainer, event_file_writer, relaunches_script

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


@pytest.mark.parametrize(("strategy", "relaunches"), [("ddp", True), ("ddp_spawn", False)])
def test_which_strategies_relaunch_the_script(strategy: str, relaunches: bool) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False,
                         enable_checkpointing=False)
    assert relaunches_script(trainer) is relaunches
