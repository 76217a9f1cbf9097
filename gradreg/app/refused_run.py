"""What a refused run leaves behind: nothing.

Hydra makes a run's folder, writes its config record (``.hydra/``) there and opens the log file
(``train.log``) before the app sees the configuration. A run the app then refuses (a
:class:`~gradreg.app.errors.ConfigError`: a value out of range, an object that cannot be built, a
checkpoint that cannot be resumed) trained nothing, and its folder would only hold those files:
:func:`discard_folder` removes it. Only a folder the app named itself is removed (a new one,
claimed by :func:`gradreg.app.run_names.claim_folder`; not one named with ``hydra.run.dir``,
``hydra.sweep.dir`` or ``hydra.sweep.subdir``), and only where it holds nothing but Hydra's
record and the log files. A ``debug=fast_dev_run``, which writes nothing, removes its folder the
same way (:func:`gradreg.app.training.fit`).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from .console import log_files

#: the overrides that name a run's folder: such a folder may have existed before the run
FOLDER_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")


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
