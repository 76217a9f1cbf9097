"""Runs of scripts/train.py for the tests of the app: as a user runs it (a subprocess), or in
this process (the same ``__main__``), with a training budget of a few batches."""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

from .conftest import QUIET, ROOT, SCRIPT

# a few batches: the budget of the tests that train for real
TINY = ["trainer.max_epochs=1", "+trainer.limit_train_batches=3", "+trainer.limit_val_batches=1",
        "+trainer.limit_test_batches=1", "trainer.enable_progress_bar=false"]


def run_script(*args: str) -> subprocess.CompletedProcess:
    """``python scripts/train.py *args`` as a user runs it: a new Python in the checkout, without
    ``HYDRA_FULL_ERROR``, nothing on stdin; its output captured."""
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=300)


def run_in_process(*args: str, tmp_path: Path) -> None:
    """``python scripts/train.py *args`` in this process (the same ``__main__``, no new Python)."""
    argv = sys.argv
    sys.argv = [str(SCRIPT), *args, f"hydra.run.dir={tmp_path}", *QUIET]
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv = argv


def hparams(log_dir: Path) -> dict[str, float | str]:
    """The hyperparameters a run gave TensorBoard's HParams tab."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = EventAccumulator(str(log_dir)).Reload().PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    return {name: value.number_value if value.HasField("number_value") else value.string_value
            for name, value in start.session_start_info.hparams.items()}


def check_two_process_gan_run(result: subprocess.CompletedProcess, run_dir: Path) -> None:
    """A GAN recipe (WGAN-GP, weight 0.1) with its dashboards trained on 2 processes: it exits 0,
    and its TensorBoard folder is written by one process (rank 0; the event files' names end in
    the writer's process id) with the run's row of the HParams table."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Starting with 2 processes" in result.stdout + result.stderr
    log_dir = run_dir
    writers = {path.name.split(".")[-2] for path in log_dir.glob("events.out.tfevents.*")}
    assert len(writers) == 1, f"event files of processes {sorted(writers)}: one expected"
    row = hparams(log_dir)
    assert (row["penalty"], row["weight"], row["n_critic"]) == ("wgan_gp", 0.1, 5)


# three epochs of the digits' 20 batches: long enough to be stopped in the middle
LONG = ["trainer.max_epochs=3", "logger=none", "+trainer.limit_val_batches=1",
        "+trainer.limit_test_batches=1", "trainer.enable_progress_bar=false"]


def one_error_line(stderr: str) -> str:
    """The last line of stderr, checked to be the run's only error and no traceback."""
    assert "Traceback" not in stderr and stderr.count("error:") == 1, stderr[-3000:]
    return stderr.splitlines()[-1]


def start(*args: str) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)


def terminate_after(process: subprocess.Popen, pattern: str, folder: Path,
                    signum: signal.Signals = signal.SIGTERM) -> str:
    """Send ``signum`` once a file matching ``pattern`` exists under ``folder`` (training is then
    past its first epoch); the process's stderr once it has ended."""
    deadline = time.monotonic() + 240
    while not any(folder.glob(pattern)):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first epoch's checkpoint never appeared"
        time.sleep(0.02)
    process.send_signal(signum)
    return process.communicate(timeout=120)[1]
