"""The app's one error, :class:`ConfigError` (a part of the configuration that cannot be used,
its message starting with the config key), and how a run ends with it: one line on stderr and
exit status 2 (:func:`exit_with`), leaving nothing behind (:func:`discard_folder`).

Hydra makes a run's folder, writes its config record (``.hydra/``) there and opens the log file
(``train.log``) before the app sees the configuration. A run the app then refuses (a
:class:`ConfigError`: a value out of range, an object that cannot be built, a checkpoint that
cannot be resumed) trained nothing, and its folder would only hold those files:
:func:`discard_folder` removes it. Only a folder the app named itself is removed (a new one,
claimed by :func:`gradreg.app.run_names.claim_folder`; not one named with ``hydra.run.dir``,
``hydra.sweep.dir`` or ``hydra.sweep.subdir``), and only where it holds nothing but Hydra's
record and the log files. A ``debug=fast_dev_run``, which writes nothing, removes its folder the
same way (:func:`gradreg.app.training.fit`).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException

from ..console import log_files, say

#: the overrides that name a run's folder: such a folder may have existed before the run
FOLDER_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")


class ConfigError(Exception):
    """A part of the configuration cannot be used; the message starts with its key."""


def exit_with(error: Exception) -> NoReturn:
    """End the run with status 2 and one line on stderr: the :class:`ConfigError`'s message,
    or ``training: <error>`` for an error met while training (``HYDRA_FULL_ERROR=1``: raise it,
    with its traceback). A refused run (a ConfigError) leaves no folder behind
    (:func:`discard_folder`)."""
    refused = isinstance(error, ConfigError)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        if refused:
            discard_folder()
        raise error
    where = "" if refused else "training: "
    say(f"error: {where}{error}  (HYDRA_FULL_ERROR=1 shows the traceback)", sys.stderr)
    if refused:
        discard_folder()
    sys.exit(2)


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


def named_on_command_line(overrides: Iterable[str]) -> bool:
    """Whether ``overrides`` name the run's folder (a key of :data:`FOLDER_KEYS`)."""
    return any(o.split("=", 1)[0].lstrip("+~") in FOLDER_KEYS for o in overrides)


def discard_folder() -> None:
    """Remove the folder of this run, where the app named it and it holds only Hydra's record
    (``.hydra/``) and the log files; then the date folder above it and the runs folder above
    that (``outputs/``), each where it is left empty.
    The log files are closed first (their handlers leave the root logger)."""
    if not HydraConfig.initialized():
        return
    config = HydraConfig.get()
    if named_on_command_line([*config.overrides.hydra, *config.overrides.task]):
        return
    folder = Path(config.runtime.output_dir)
    logs = {Path(handler.baseFilename) for handler in log_files()}
    if not folder.is_dir() or not set(folder.iterdir()) <= {folder / ".hydra", *logs}:
        return
    for handler in log_files():
        logging.getLogger().removeHandler(handler)
        handler.close()
    shutil.rmtree(folder / ".hydra", ignore_errors=True)
    for log in logs:
        log.unlink(missing_ok=True)
    folder.rmdir()
    for above in (folder.parent, folder.parent.parent):  # <runs>/<label>_<date>, then <runs>
        if any(above.iterdir()):
            break
        above.rmdir()
