"""An interrupted checkpoint save never replaces a good checkpoint (AtomicCheckpointIO)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from gradreg.lightning.checkpoint import AtomicCheckpointIO, CheckpointSaveError

GOOD = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 7}


class FailsWhenPickled:
    """Stands for a crash in the middle of serialization: the file is already partly written."""

    def __reduce__(self):
        raise RuntimeError("simulated crash mid-save")


def assert_good(path: Path) -> None:
    loaded = torch.load(path, weights_only=True)
    assert loaded["global_step"] == 7 and torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))


def test_save_then_load_round_trip(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    io.save_checkpoint(GOOD, tmp_path / "sub" / "last.ckpt")
    assert_good(tmp_path / "sub" / "last.ckpt")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["last.ckpt"]


def test_failed_save_keeps_the_previous_checkpoint_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(GOOD, path)
    bad = {"state_dict": {"w": torch.zeros(10_000)}, "broken": FailsWhenPickled()}
    with pytest.raises(RuntimeError, match="simulated crash mid-save"):
        io.save_checkpoint(bad, path)
    assert_good(path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


class FillsTheDisk:
    """A disk that fills up in the middle of serialization: ``write`` raises ENOSPC."""

    def __reduce__(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_a_save_error_naming_the_file_and_keeps_the_previous(
        tmp_path: Path) -> None:
    """Before: a bare OSError traceback out of the fit."""
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(GOOD, path)
    with pytest.raises(CheckpointSaveError) as error:
        io.save_checkpoint({"state_dict": {"w": torch.zeros(10_000)}, "x": FillsTheDisk()}, path)
    assert isinstance(error.value, OSError) and error.value.errno == errno.ENOSPC
    assert str(error.value).startswith(
        f"could not save the checkpoint {path} (No space left on device); the previous "
        "checkpoint there, if any, is intact")
    assert_good(path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


class KillsWhenPickled:
    """A hard crash (``os._exit``: no cleanup, no flush) in the middle of serialization."""

    def __reduce__(self):
        os._exit(3)


def test_process_killed_mid_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """A forked process dies while writing the new checkpoint: the previous one is still complete;
    only a stray temporary file is left."""
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(GOOD, path)
    child = os.fork()
    if child == 0:  # the child never returns into pytest
        try:
            checkpoint = {"state_dict": {"w": torch.zeros(100_000)}, "x": KillsWhenPickled()}
            AtomicCheckpointIO().save_checkpoint(checkpoint, path)
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    assert_good(path)
    assert {p.suffix for p in tmp_path.iterdir()} == {".ckpt", ".tmp"}


def test_storage_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint(GOOD, tmp_path / "x.ckpt", storage_options={"a": 1})


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_checkpoints_get_the_mode_of_the_users_umask(tmp_path: Path, umask: int,
                                                     mode: int) -> None:
    """Before: always 0600, the temporary file's mode."""
    previous = os.umask(umask)
    try:
        AtomicCheckpointIO().save_checkpoint(GOOD, tmp_path / "last.ckpt")
    finally:
        os.umask(previous)
    assert (tmp_path / "last.ckpt").stat().st_mode & 0o777 == mode
