"""The files a run writes and reads, checked before it trains: an output folder it can write
(:func:`check_writable`) and a complete checkpoint to resume from (:func:`resolve_checkpoint`)."""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

from .errors import ConfigError


def check_writable(output_dir: Path) -> None:
    """Raise ConfigError unless ``output_dir`` can be created and written (before training, so
    that a run's metrics and checkpoints are never lost at its end)."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as error:
        raise ConfigError(
            f"paths.output_dir: cannot write to {str(output_dir)!r} ({error.strerror or error}); "
            "choose a folder you can write: a new paths.output_dir=<folder>, or "
            "paths.runs=<folder> (a new folder under it for every run)"
        ) from error


def resolve_checkpoint(ckpt_path: str | None, runs_root: Path, output_dir: Path) -> Path | None:
    """The checkpoint file to resume from, checked to be a complete one.

    ``ckpt_path`` is a checkpoint file; or a run folder (its ``checkpoints/last.ckpt``); or
    ``last``: the newest ``checkpoints/last.ckpt`` of the runs under ``runs_root`` (other than
    the current run, ``output_dir``). None: a fresh run.
    """
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        candidates = [p for p in runs_root.glob("**/checkpoints/last.ckpt")
                      if output_dir.resolve() not in p.resolve().parents]
        if not candidates:
            raise ConfigError(
                f"ckpt_path: 'last' resumes the newest checkpoints/last.ckpt under "
                f"{str(runs_root)!r}, and there is none; pass the checkpoint file or run folder "
                "to resume, e.g. ckpt_path=outputs/<penalty>:<weight>_<date>/<time>"
            )
        path = max(candidates, key=lambda p: p.stat().st_mtime)
    else:
        path = Path(ckpt_path).expanduser()
        if path.is_dir():
            path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise ConfigError(
            f"ckpt_path: {str(path)!r} is not a file; pass a checkpoint (a run's "
            "checkpoints/*.ckpt), a run folder, or 'last'"
        )
    if not zipfile.is_zipfile(path):
        size = os.path.getsize(path)
        raise ConfigError(
            f"ckpt_path: {str(path)!r} is not a complete checkpoint ({size} bytes, "
            f"{'empty' if size == 0 else 'truncated or not written by torch.save'}); resume from "
            "another checkpoint of the run"
        )
    return path
