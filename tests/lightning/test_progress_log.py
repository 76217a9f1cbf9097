"""ProgressLog: the lines a run writes where no progress bar is drawn, their values, cadence and
rate, and where they go (the logger, stdout without one; the app's console and train.log)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from gradreg.lightning.callbacks import ProgressLog
from gradreg.lightning.callbacks import progress_log as module
from tests.app.conftest import ROOT, SCRIPT
from tests.app.helpers import TINY

from .helpers import PlainClassifier, data, loader, trainer

LOGGER = module.__name__


@pytest.fixture(autouse=True)
def enabled_logger(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's logger enabled: an in-process run of the app under
    ``hydra/job_logging=disabled`` (tests/app) disables every logger that exists then."""
    monkeypatch.setattr(logging.getLogger(LOGGER), "disabled", False)


class Clock:
    """A clock the test moves: 0.5 s per training batch, 100 s per validation batch."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class TimedClassifier(PlainClassifier):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        self.clock.now += 0.5
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.clock.now += 100.0
        super().validation_step(batch, batch_idx)


def run(tmp_path: Path, callback: ProgressLog, clock: Clock | None = None,
        monkeypatch: pytest.MonkeyPatch | None = None, **kwargs: object) -> None:
    """Two epochs of 4 batches of 2 (lr = 0: every value is that of the initial model), one
    validation batch after each epoch, then one test."""
    clock = clock or Clock()
    if monkeypatch is not None:
        monkeypatch.setattr(module, "time", clock)
    model = TimedClassifier(clock)
    options = {"max_steps": -1, "max_epochs": 2, "limit_val_batches": 1, "logger": False,
               "num_sanity_val_steps": 0, **kwargs}
    run = trainer(tmp_path, [callback], **options)
    run.fit(model, loader(batch_size=2), loader(batch_size=2))
    run.test(model, loader(batch_size=8), verbose=False)


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER]


def expected_metrics() -> dict[str, str]:
    """The values the lines must show: the initial model's losses on the last training batch
    (samples 6 and 7), its validation batch (samples 0 and 1) and the test batch (all 8)."""
    inputs, labels = data()
    model = PlainClassifier()
    with torch.no_grad():
        last = F.cross_entropy(model(inputs[6:]), labels[6:])
        val = F.cross_entropy(model(inputs[:2]), labels[:2])
        test = F.cross_entropy(model(inputs), labels)
        val_acc = (model(inputs[:2]).argmax(1) == labels[:2]).float().mean()
        test_acc = (model(inputs).argmax(1) == labels).float().mean()
    return {"train": f"train/loss {float(last):.4g}", "val": f"val/acc {float(val_acc):.4g}  "
            f"val/loss {float(val):.4g}", "test": f"test/acc {float(test_acc):.4g}  "
            f"test/loss {float(test):.4g}"}


def test_lines_every_n_batches_at_each_epochs_end_validation_and_test(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """Every 3 batches and at the epoch's last (4): batches 3 and 4 of each epoch; the rate is
    2 it/s (0.5 s a batch) also across the validations, which take 100 s of the clock."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    run(tmp_path, ProgressLog(every_n_batches=3, every_seconds=None, enabled=True),
        monkeypatch=monkeypatch)
    value = expected_metrics()
    got = lines(caplog)
    assert [line.split("  train/loss")[0] for line in got] == [
        "epoch 0  batch 3/4  step 3", "epoch 0  batch 4/4  step 4",
        f"epoch 0  validation  {value['val']}",
        "epoch 1  batch 3/4  step 7", "epoch 1  batch 4/4  step 8",
        f"epoch 1  validation  {value['val']}",
        f"test  {value['test']}"]
    batch_lines = [line for line in got if " batch " in line]
    assert all(line.endswith("  2 it/s") for line in batch_lines), batch_lines
    # lr = 0: the last batch of each epoch has the initial model's loss on samples 6 and 7
    assert f"batch 4/4  step 4  {value['train']}  2 it/s" in got[1]
    assert f"batch 4/4  step 8  {value['train']}  2 it/s" in got[4]


def test_lines_every_n_seconds(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                               monkeypatch: pytest.MonkeyPatch):
    """Every 1 s of the clock, 0.5 s a batch: batches 2 and 4 of each epoch."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    run(tmp_path, ProgressLog(every_n_batches=None, every_seconds=1.0, enabled=True),
        monkeypatch=monkeypatch, limit_val_batches=0)
    assert [line.split("  train/")[0] for line in lines(caplog) if " batch " in line] == [
        "epoch 0  batch 2/4  step 2", "epoch 0  batch 4/4  step 4",
        "epoch 1  batch 2/4  step 6", "epoch 1  batch 4/4  step 8"]


@pytest.mark.parametrize(("terminal", "enabled", "written"), [
    (False, None, True), (True, None, False), (True, True, True), (False, False, False)])
def test_written_where_stdout_is_not_a_terminal_unless_told(
        terminal: bool, enabled: bool | None, written: bool, tmp_path: Path,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)
    run(tmp_path, ProgressLog(enabled=enabled), limit_val_batches=0)
    assert bool(lines(caplog)) == written


def test_printed_to_stdout_where_logging_has_no_handler(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(logging.getLogger(LOGGER), "propagate", False)
    run(tmp_path, ProgressLog(every_n_batches=None, every_seconds=None, enabled=True),
        limit_val_batches=0)
    printed = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith(("epoch", "test"))]
    assert [line.split("  train/")[0].split("  test/")[0] for line in printed] == [
        "epoch 0  batch 4/4  step 4", "epoch 1  batch 4/4  step 8", "test"]


def test_only_global_rank_zero_writes():
    callback = ProgressLog(enabled=True)
    callback.setup(SimpleNamespace(is_global_zero=False), None, "fit")
    assert not callback._active
    callback.setup(SimpleNamespace(is_global_zero=True), None, "fit")
    assert callback._active


@pytest.mark.parametrize(("options", "message"), [
    ({"every_n_batches": 0}, "every_n_batches must be an int >= 1 or None; got 0."),
    ({"every_n_batches": True}, "every_n_batches must be an int >= 1 or None; got True."),
    ({"every_n_batches": 2.5}, "every_n_batches must be an int >= 1 or None; got 2.5."),
    ({"every_seconds": 0}, "every_seconds must be a number > 0 or None; got 0."),
    ({"every_seconds": float("nan")}, "every_seconds must be a number > 0 or None; got nan."),
    ({"every_seconds": "30"}, "every_seconds must be a number > 0 or None; got '30'."),
    ({"prefixes": "train/"}, "write prefixes=['train/']."),
])
def test_bad_options_are_refused_naming_them(options: dict, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        ProgressLog(**options)


def test_the_apps_run_writes_the_lines_to_its_output_file_and_train_log(tmp_path: Path):
    """``python scripts/train.py > out.txt``: stdout is a file, so no bar is drawn and the
    callback writes: 3 training batches, a line every 2, so batches 2 and 3, then the
    validation and the test; train.log in the run folder holds the same lines."""
    run_dir = tmp_path / "run"
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    with (tmp_path / "out.txt").open("w") as out:
        result = subprocess.run(
            [sys.executable, str(SCRIPT), *[arg for arg in TINY if "progress_bar" not in arg],
             "callbacks.progress_log.every_n_batches=2", f"hydra.run.dir={run_dir}"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    shown = [line for line in (tmp_path / "out.txt").read_text().splitlines() if LOGGER in line]
    logged = [line for line in (run_dir / "train.log").read_text().splitlines()
              if LOGGER in line]
    assert shown == logged
    messages = [line.split(" - ", 1)[1] for line in logged]
    assert [re.sub(r"  (train|val|test)/.*", "", message) for message in messages] == [
        "epoch 0  batch 2/3  step 2", "epoch 0  batch 3/3  step 3", "epoch 0  validation",
        "test"]
    assert re.fullmatch(r"epoch 0  batch 3/3  step 3  train/loss [0-9.]+  "
                        r"train/penalty/double_backprop [0-9.e-]+  train/total [0-9.]+  "
                        r"[0-9.]+ it/s", messages[1]), messages[1]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert f"test/acc {metrics['test/acc']:.4g}" in messages[3]
