"""The optional packages of the layers above the core, and one clear error where one is missing.

``pip install gradreg`` installs the core (``gradreg``, :mod:`gradreg.penalties`,
:mod:`gradreg.models`, :mod:`gradreg.evaluation`), which needs torch alone. The Lightning layer
(:mod:`gradreg.lightning`, :mod:`gradreg.data`) needs the packages of the ``lightning`` extra; its
packages call :func:`require` when they are imported, so that a missing one is an
``ImportError`` naming the extra to install instead of a ``ModuleNotFoundError`` from deep inside
a module; the app (:mod:`gradreg.app`) checks the ``app`` extra (Hydra and the ``lightning``
extra) the
same way. The check looks the packages up without importing them: ``import gradreg.lightning``
stays cheap.
"""

from __future__ import annotations

from importlib.util import find_spec

#: import name -> distribution name, where they differ
DISTRIBUTIONS = {"sklearn": "scikit-learn", "hydra": "hydra-core"}


def installed(module: str) -> bool:
    """Whether the top-level ``module`` can be imported (found, and not blocked by an entry
    ``sys.modules[module] = None``), without importing it."""
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):  # blocked by an import hook, or a broken entry
        return False


def require(extra: str, needed_by: str, *modules: str) -> None:
    """Raise an ``ImportError`` naming ``extra`` if one of the top-level ``modules`` that
    ``needed_by`` imports is not installed, e.g.::

        gradreg.lightning needs lightning, tensorboard, which are not installed:
        pip install 'gradreg[lightning]' (in a checkout: pip install -e '.[lightning]')

    (one line)."""
    missing = [DISTRIBUTIONS.get(module, module) for module in modules if not installed(module)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ImportError(f"{needed_by} needs {', '.join(missing)}, which {verb} not installed: "
                          f"pip install 'gradreg[{extra}]' (in a checkout: pip install -e "
                          f"'.[{extra}]')")
