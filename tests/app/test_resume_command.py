"""Resuming as the documentation says: the commands of docs/reliability.md run exactly as written
(from a folder that holds the scripts and configs, as a checkout does), and what a resume does
with the penalty weights of the command line and of the checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import CONFIGS, ROOT, SCRIPT

DOC = ROOT / "docs" / "reliability.md"


def documented_resume_commands() -> list[str]:
    """The command lines of the first bash block of the "Exact resume" section."""
    section = DOC.read_text().split("## Exact resume", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A working folder with ``scripts`` and ``configs`` where a checkout has them."""
    (tmp_path / "scripts").symlink_to(SCRIPT.parent)
    (tmp_path / "configs").symlink_to(CONFIGS)
    return tmp_path


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    args = command.split()
    assert args[:2] == ["python", "scripts/train.py"], command
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, *args[1:]], cwd=cwd, env=env, text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=300)


@pytest.mark.slow
def test_the_documented_resume_commands_run_as_written(checkout: Path) -> None:
    """First run: 2 epochs of 20 steps, checkpoints epoch1-step40.ckpt and last.ckpt. The
    resume continues from that last.ckpt for one more epoch (step 60) in a folder of its own."""
    commands = documented_resume_commands()
    assert commands == ["python scripts/train.py trainer.max_epochs=2",
                        "python scripts/train.py trainer.max_epochs=3 ckpt_path=last"]
    first = run(commands[0], checkout)
    assert first.returncode == 0, first.stderr[-3000:]
    (first_run,) = (checkout / "outputs").glob("*/*")
    assert sorted(p.name for p in (first_run / "checkpoints").iterdir()) == [
        "epoch1-step40.ckpt", "last.ckpt"]
    second = run(commands[1], checkout)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming from {Path('outputs') / first_run.relative_to(checkout / 'outputs')}" \
           f"/checkpoints/last.ckpt" in second.stdout
    runs = sorted((checkout / "outputs").glob("*/*"))
    assert len(runs) == 2 and (runs[1] / "checkpoints" / "epoch2-step60.ckpt").is_file()


TINY = ["+trainer.limit_train_batches=2", "+trainer.limit_val_batches=1",
        "+trainer.limit_test_batches=1", "callbacks=default", "logger=none"]


def resume(checkout: Path, first: list[str], second: list[str]) -> subprocess.CompletedProcess:
    """A one-epoch run with the overrides ``first``, resumed for a second epoch with ``second``."""
    done = run(" ".join(["python scripts/train.py trainer.max_epochs=1", *TINY, *first]),
               checkout)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = run(" ".join(["python scripts/train.py trainer.max_epochs=2 ckpt_path=last",
                            *TINY, *second]), checkout)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return resumed


@pytest.mark.slow
def test_a_weight_on_the_resume_command_line_replaces_the_checkpoints(checkout: Path) -> None:
    """Before: penalty.weight=5 on resume was silently ignored (the checkpoint's 0.1 won)."""
    resumed = resume(checkout, [], ["penalty.weight=5"])
    assert ("resume: penalty 'double_backprop' weight 5.0 from the command line (the "
            "checkpoint had 0.1)") in resumed.stdout
    (last,) = (p for p in (checkout / "outputs").glob("*/*/checkpoints/last.ckpt")
               if "epoch1" in " ".join(q.name for q in p.parent.iterdir()))
    state = torch.load(last, weights_only=False)["state_dict"]
    assert state["penalties.double_backprop._extra_state"] == {"weight": 5.0}


@pytest.mark.slow
def test_a_weight_the_command_line_does_not_repeat_comes_from_the_checkpoint(
        checkout: Path) -> None:
    resumed = resume(checkout, ["penalty.weight=0.3"], [])
    assert ("resume: penalty 'double_backprop' weight 0.3 from the checkpoint (the config says "
            "0.1;") in resumed.stdout


@pytest.mark.parametrize(("content", "what"), [(b"", "0 bytes, empty"),
                                               (None, "truncated or not written by torch.save")])
def test_an_empty_or_truncated_checkpoint_is_one_line(checkout: Path, content: bytes | None,
                                                      what: str) -> None:
    """Before: a bare EOFError and a 41-line traceback."""
    if content is None:  # the first half of a real checkpoint
        torch.save({"w": torch.zeros(1000)}, checkout / "whole.ckpt")
        content = (checkout / "whole.ckpt").read_bytes()[:2000]
    (checkout / "broken.ckpt").write_bytes(content)
    result = run("python scripts/train.py ckpt_path=broken.ckpt", checkout)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ckpt_path: 'broken.ckpt' is not a complete "
                                    f"checkpoint ({len(content)} bytes") and what in result.stderr


def test_last_without_any_run_says_what_to_pass(checkout: Path) -> None:
    """Before: ckpt_path=last silently trained from scratch (status 0)."""
    result = run("python scripts/train.py ckpt_path=last", checkout)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ckpt_path: 'last' resumes the newest "
                                    "checkpoints/last.ckpt under 'outputs', and there is none")
