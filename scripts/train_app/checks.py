"""What the app checks before it trains: values a run cannot use, a folder it cannot write, a
checkpoint it cannot load. Each failure is a :class:`ConfigError` whose message starts with the
config key, so that ``train.py`` prints it as one line and exits with status 2."""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from omegaconf import DictConfig


class ConfigError(Exception):
    """A part of the configuration cannot be used; the message starts with its key."""


@contextmanager
def building(key: str) -> Iterator[None]:
    """Turn any error raised while building ``key`` into a ConfigError naming ``key``."""
    try:
        yield
    except Exception as error:
        while _hydra_wrapper(error):  # report what the constructor or the import said
            error = error.__cause__
        raise ConfigError(f"{key}: {error or type(error).__name__}") from error


def _hydra_wrapper(error: BaseException) -> bool:
    """Whether ``error`` is Hydra's wrapper of another: an InstantiationException, or the
    ImportError ("Error loading '<_target_>'") of a target whose module failed to import."""
    if error.__cause__ is None:
        return False
    return isinstance(error, InstantiationException) or (
        isinstance(error, ImportError) and str(error).startswith("Error loading"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: key -> (test of the value, what the value must be); checked before anything is built.
VALUE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (_is_int, "an integer"),
    "threads": (lambda v: v is None or (_is_int(v) and v >= 1),
                "an integer >= 1 (torch's CPU threads), or null for torch's default"),
    "trainer.max_epochs": (lambda v: v is None or (_is_int(v) and v >= 1),
                           "an integer >= 1 (0 would report the untrained model's metrics as "
                           "results; -1, training without end, is not offered: set "
                           "+trainer.max_steps=<N> instead)"),
    "trainer.max_steps": (lambda v: _is_int(v) and (v == -1 or v >= 1),
                          "an integer >= 1, or -1 for no step limit"),
    "data.batch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
}


def check_values(cfg: DictConfig) -> None:
    """Raise ConfigError for the first value of :data:`VALUE_RULES` that breaks its rule."""
    for key, (valid, requirement) in VALUE_RULES.items():
        section, _, name = key.rpartition(".")
        node = cfg.get(section) if section else cfg
        if node is None or name not in node:
            continue
        value = node[name]
        if not valid(value):
            raise ConfigError(f"{key}: must be {requirement}, got {value!r}")


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
            "choose a folder you can write, e.g. paths.output_dir=outputs/my_run"
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
                "to resume, e.g. ckpt_path=outputs/<date>/<time>"
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
