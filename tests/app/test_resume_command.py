"""Resuming as the documentation says: the commands of docs/reliability.md run exactly as written
(from a folder that holds the scripts and configs, as a checkout does), what a resume does with
the penalty weights of the command line and of the checkpoint, and the runs that used to be lost
or wrong without a word (a preempted run, a run folder used twice, a checkpoint of another model,
a full disk during a save)."""

from __future__ import annotations

import errno
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .conftest import CONFIGS, ROOT, SCRIPT
from .helpers import LONG, TINY, one_error_line, run_in_process, start, terminate_after

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


RESUME_OVERRIDES = ["+trainer.limit_train_batches=2", "+trainer.limit_val_batches=1",
        "+trainer.limit_test_batches=1", "callbacks=default", "logger=none"]


def resume(checkout: Path, first: list[str], second: list[str]) -> subprocess.CompletedProcess:
    """A one-epoch run with the overrides ``first``, resumed for a second epoch with ``second``."""
    done = run(" ".join(["python scripts/train.py trainer.max_epochs=1", *RESUME_OVERRIDES,
                         *first]), checkout)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = run(" ".join(["python scripts/train.py trainer.max_epochs=2 ckpt_path=last",
                            *RESUME_OVERRIDES, *second]), checkout)
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


# Runs that used to be lost or wrong without a word: a preempted run (SIGTERM), a run folder
# used twice, checkpoints written with ``callbacks=none``, a checkpoint of another model or penalty
# set, ``ckpt_path=last`` reaching into another experiment, a full disk during a save. Each now
# ends right, or with one line (status 2; 143 for SIGTERM, 130 for Ctrl-C).
QUICK = [*TINY, "logger=none"]


def test_sigterm_saves_the_run_says_how_to_resume_and_the_resume_completes(
        tmp_path: Path) -> None:
    """Before: status 0 at the end of the epoch, no metrics, no checkpoint past the last epoch
    end. Now: status 143 after the current batch and one line naming the checkpoint (the step the
    run reached) and the command that resumes it; that command ends the run at its 60th step (3
    epochs of 20 batches)."""
    first = tmp_path / "first"
    process = start(*LONG, f"hydra.run.dir={first}")
    stderr = terminate_after(process, "checkpoints/epoch0-*.ckpt", first)
    assert process.returncode == 143, stderr[-3000:]
    line = one_error_line(stderr)
    saved = first / "checkpoints" / "last.ckpt"
    step = torch.load(saved, weights_only=False)["global_step"]
    assert 20 <= step < 40  # within the epoch it was stopped in (Lightning waited for its end)
    command = ("python scripts/train.py " + " ".join(LONG) + f" ckpt_path={saved}")
    assert line.startswith("error: stopped by SIGTERM at epoch 1 step ") or step == 20
    assert line.endswith(f" step {step}: saved {saved}; resume with: {command}")
    assert not (first / "metrics.json").exists()
    args = shlex.split(line.split("resume with: ", 1)[1])[2:]
    resumed = subprocess.run([sys.executable, str(SCRIPT), *args,
                              f"hydra.run.dir={tmp_path / 'resumed'}"],
                             cwd=ROOT, text=True, capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {saved}" in resumed.stdout
    final = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=False)
    assert (final["global_step"], final["epoch"]) == (60, 2)


@pytest.mark.slow
def test_ctrl_c_saves_the_run_and_says_how_to_resume_with_status_130(tmp_path: Path) -> None:
    """Before: status 1 and Lightning's 'Detected KeyboardInterrupt, attempting graceful
    shutdown' only. Now, as for SIGTERM: the run stops after the current batch, saves
    checkpoints/last.ckpt at the step it reached and says so in one line with the command that
    resumes it; status 130 (128 + SIGINT, what a shell reports for Ctrl-C)."""
    first = tmp_path / "first"
    process = start(*LONG, f"hydra.run.dir={first}")
    stderr = terminate_after(process, "checkpoints/epoch0-*.ckpt", first, signal.SIGINT)
    assert process.returncode == 130, stderr[-3000:]
    assert "KeyboardInterrupt" not in stderr
    line = one_error_line(stderr)
    saved = first / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(saved, weights_only=False)
    step, epoch = checkpoint["global_step"], checkpoint["epoch"]
    assert 20 <= step < 60
    command = "python scripts/train.py " + " ".join(LONG) + f" ckpt_path={saved}"
    assert line == (f"error: stopped by SIGINT (Ctrl-C) at epoch {epoch} step {step}: saved "
                    f"{saved}; resume with: {command}")
    assert not (first / "metrics.json").exists()


@pytest.mark.slow
def test_the_error_line_of_a_stop_starts_after_the_progress_bar(tmp_path: Path) -> None:
    """tqdm's bar, redrawn with carriage returns, ends mid-line when Ctrl-C stops the run; the
    error line (stderr, on the same terminal) started right after it: "...it/s]error: stopped"
    (Rich's bar ends its own line)."""
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), *LONG, "trainer.enable_progress_bar=true",
         "+callbacks.bar={_target_:lightning.pytorch.callbacks.TQDMProgressBar}",
         f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not any(tmp_path.glob("checkpoints/epoch0-*.ckpt")):  # the first epoch is done
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the first epoch's checkpoint never appeared"
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 130, output[-3000:]
    before, _ = output.split("error: stopped by SIGINT", 1)
    assert "Epoch 1:" in before and before.endswith("\n"), repr(before[-300:])


def test_sigterm_stops_a_sweep_with_status_143(tmp_path: Path) -> None:
    """Before: the sweep went on to its next job and ended with status 0."""
    process = start("-m", "seed=0,1", *LONG, f"hydra.sweep.dir={tmp_path}")
    stderr = terminate_after(process, "*/checkpoints/epoch0-*.ckpt", tmp_path)
    assert process.returncode == 143, stderr[-3000:]
    assert one_error_line(stderr).startswith("error: stopped by SIGTERM at epoch 1")
    (job,) = (path for path in tmp_path.iterdir() if path.is_dir())
    assert job.name.startswith("000_") and (job / "checkpoints" / "last.ckpt").is_file()


def test_an_output_folder_with_another_runs_results_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the second run wrote its checkpoints next to the first's, and a later
    ckpt_path=<folder> resumed whichever last.ckpt was written last."""
    folder = tmp_path / "run"
    run_in_process(*QUICK, f"paths.output_dir={folder}", tmp_path=folder)
    assert (folder / "metrics.json").is_file()
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(*QUICK, f"paths.output_dir={folder}", tmp_path=folder)
    assert exit_info.value.code == 2
    assert one_error_line(capsys.readouterr().err).startswith(
        f"error: paths.output_dir: {str(folder)!r} holds another run's results (checkpoints, "
        "metrics.json); every run writes to a folder of its own")


def test_callbacks_none_writes_no_checkpoint(tmp_path: Path) -> None:
    """Before: Lightning's default ModelCheckpoint wrote checkpoints/epoch=0-step=3.ckpt (an `=`
    in the name, no last.ckpt) although the config says no checkpoints."""
    run_in_process(*QUICK, "callbacks=none", tmp_path=tmp_path)
    assert (tmp_path / "metrics.json").is_file()
    assert list(tmp_path.rglob("*.ckpt")) == []


def first_run(tmp_path: Path, *overrides: str) -> Path:
    """A tiny run (with checkpoints) in a new folder under ``tmp_path/runs``; its folder."""
    folder = tmp_path / "runs" / f"run{len(list((tmp_path / 'runs').glob('run*')))}"
    run_in_process(*QUICK, "callbacks=default", *overrides, tmp_path=folder)
    assert (folder / "checkpoints" / "last.ckpt").is_file()
    return folder


def test_a_checkpoint_of_another_penalty_set_is_one_line_naming_both(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a 30-line traceback out of load_state_dict (unexpected keys)."""
    run = first_run(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(*QUICK, "penalty=jacobian", f"ckpt_path={run}", tmp_path=tmp_path / "new")
    assert exit_info.value.code == 2
    assert one_error_line(capsys.readouterr().err).startswith(
        f"error: ckpt_path: {str(run / 'checkpoints' / 'last.ckpt')!r} is a checkpoint of "
        "Classifier with penalties double_backprop (points=inputs); this run builds Classifier "
        "with penalties jacobian (points=inputs): resume with the model and penalties of that run")


def test_a_checkpoint_of_another_model_is_one_line_naming_the_difference(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = first_run(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(*QUICK, "model.backbone.hidden=[128,16]", f"ckpt_path={run}",
                       tmp_path=tmp_path / "new")
    assert exit_info.value.code == 2
    assert ("is a checkpoint of another model than this run's Classifier: it has other shapes: "
            "backbone.fc2.weight [128, 128] (here [16, 128])"
            ) in one_error_line(capsys.readouterr().err)


def test_a_checkpoint_without_the_identity_still_resumes_where_its_state_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checkpoints written before the identity field are checked on their state alone."""
    run = first_run(tmp_path)
    path = run / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint.pop("gradreg") == {
        "schema": 1, "module": "gradreg.lightning.classifier.Classifier",
        "penalties": {"double_backprop": "inputs"}}
    torch.save(checkpoint, path)
    run_in_process(*QUICK, "trainer.max_epochs=2", f"ckpt_path={run}", tmp_path=tmp_path / "new")
    assert f"resuming from {path}" in capsys.readouterr().out
    assert torch.load(tmp_path / "new" / "checkpoints" / "last.ckpt",
                      weights_only=False)["global_step"] == 6


def test_last_resumes_the_newest_run_of_the_same_model_and_penalties(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ckpt_path=last took the newest last.ckpt of any experiment (here the jacobian
    run, a traceback on load)."""
    mine = first_run(tmp_path)
    other = first_run(tmp_path, "penalty=jacobian")
    assert other.stat().st_mtime >= mine.stat().st_mtime
    capsys.readouterr()
    run_in_process(*QUICK, "trainer.max_epochs=2", "ckpt_path=last",
                   f"paths.runs={tmp_path / 'runs'}", tmp_path=tmp_path / "new")
    assert f"resuming from {mine / 'checkpoints' / 'last.ckpt'}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(*QUICK, "penalty=r1", "model=gan", "data=8gaussians", "ckpt_path=last",
                       f"paths.runs={tmp_path / 'runs'}", tmp_path=tmp_path / "gan")
    assert exit_info.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: ckpt_path: 'last' resumes the newest run of this model and "
                           "penalties, and none of the 2 checkpoints/last.ckpt under")
    assert "is a checkpoint of Classifier with penalties" in line and "this run builds GAN" in line


def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_partial_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a traceback ending in OSError: [Errno 28]. The save writes part of the file, then
    the disk is full."""
    real_save = torch.save

    def save_until_full(obj: object, file: object, *args: object, **kwargs: object) -> None:
        if hasattr(file, "write"):
            file.write(b"PK\x03\x04 part of a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_full)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(*QUICK, "callbacks=default", tmp_path=tmp_path)
    assert exit_info.value.code == 2
    assert one_error_line(capsys.readouterr().err).startswith(
        f"error: training: could not save the checkpoint "
        f"{tmp_path / 'checkpoints' / 'epoch0-step3.ckpt'} (No space left on device); the "
        "previous checkpoint there, if any, is intact")
    assert list((tmp_path / "checkpoints").iterdir()) == []
