"""Runs of scripts/train.py for the tests of the app: as a user runs it (a subprocess), or in
this process (the same ``__main__``), with a training budget of a few batches."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
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
