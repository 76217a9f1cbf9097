"""The app's one error, :class:`ConfigError` (a part of the configuration that cannot be used,
its message starting with the config key), and how a run ends with it: one line on stderr and
exit status 2 (:func:`exit_with`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from hydra.errors import InstantiationException

from .console import say
from .refused_run import discard_folder


class ConfigError(Exception):
    """A part of the configuration cannot be used; the message starts with its key."""


def exit_with(error: Exception) -> NoReturn:
    """End the run with status 2 and one line on stderr: the :class:`ConfigError`'s message,
    or ``training: <error>`` for an error met while training (``HYDRA_FULL_ERROR=1``: raise it,
    with its traceback). A refused run (a ConfigError) leaves no folder behind
    (:func:`~gradreg.app.refused_run.discard_folder`)."""
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
