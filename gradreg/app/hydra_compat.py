"""Every name of Hydra's that is not public API and the app uses, in one place.

Hydra exports no public parser of its own command line; the app reads the overrides of a
command line with it (which keys a sweep varies, which plugins it selects), as Hydra itself
does. Nor has it a public hook on the errors it reports before or around the app's function
(an override that does not parse, a config file that is not YAML, a run folder it cannot
create): it prints those as a traceback with status 1, through ``run_and_report``, which the app
wraps to print its own one line instead. Each name is pinned by
``tests/app/test_hydra_compat.py``, which fails with the name and this module when a Hydra
release moves it.
"""

from __future__ import annotations

from argparse import ArgumentParser
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import hydra._internal.utils as hydra_utils
from hydra._internal.utils import get_args_parser

__all__ = ["command_line_parser", "reporting_errors"]


def command_line_parser() -> ArgumentParser:
    """Hydra's parser of its command line: the overrides (``args.overrides``) apart from its
    flags (``-m``, ``--cfg job``, ``--config-name``, ...)."""
    return get_args_parser()


@contextmanager
def reporting_errors(report: Callable[[BaseException], None]) -> Iterator[None]:
    """While the app runs, every exception Hydra would report (composing the config, creating
    the run folder, launching the jobs, or escaping the app's function) goes to
    ``report(error)`` first, which ends the run its own way or returns to leave the error to
    Hydra's report (a traceback, status 1)."""
    hydra_report = hydra_utils.run_and_report

    def run_and_report(func: Callable[[], Any]) -> Any:
        try:
            return func()
        except Exception as error:
            report(error)
            return hydra_report(_raiser(error))

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    finally:
        hydra_utils.run_and_report = hydra_report


def _raiser(error: Exception) -> Callable[[], Any]:
    def raise_error() -> Any:
        raise error
    return raise_error
