"""Every name of Hydra's that is not public API and the app uses, in one place.

Hydra exports no public parser of its own command line; the app reads the overrides of a
command line with it (which keys a sweep varies, which plugins it selects), as Hydra itself
does. Each name is pinned by ``tests/app/test_hydra_compat.py``, which fails with the name and
this module when a Hydra release moves it.
"""

from __future__ import annotations

from argparse import ArgumentParser

from hydra._internal.utils import get_args_parser

__all__ = ["command_line_parser"]


def command_line_parser() -> ArgumentParser:
    """Hydra's parser of its command line: the overrides (``args.overrides``) apart from its
    flags (``-m``, ``--cfg job``, ``--config-name``, ...)."""
    return get_args_parser()
