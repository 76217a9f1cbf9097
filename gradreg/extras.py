"""The optional packages of the layers above the core, and one clear error where one is missing.

``pip install gradreg`` installs the core (``gradreg``, :mod:`gradreg.penalties`,
:mod:`gradreg.models`, :mod:`gradreg.evaluation`), which needs torch alone. The Lightning layer
(:mod:`gradreg.lightning`, its data modules in :mod:`gradreg.lightning.data` included) needs
the packages of the ``lightning`` extra; its packages check them with :func:`missing_extra`
when they are imported, so that a missing one is an ``ImportError`` of one line naming the
extra to install, raised by the package itself (a traceback of two frames: the import and the
package), instead of a ``ModuleNotFoundError`` from deep inside a module; the app
(:mod:`gradreg.app`) checks the ``app`` extra (Hydra and the ``lightning`` extra) the same way
and prints the line alone (``error: ...``, status 2). The check looks the packages up without
importing them: ``import gradreg.lightning`` stays cheap.
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


def missing_extra(extra: str, needed_by: str, *modules: str) -> str | None:
    """The one line naming ``extra`` if one of the top-level ``modules`` that ``needed_by``
    imports is not installed, e.g.::

        gradreg.lightning needs lightning, tensorboard, which are not installed:
        pip install 'gradreg[lightning]' (in a checkout: pip install -e '.[lightning]')

    (one line); None where all are installed. A package raises it where it is imported
    (``raise ImportError(missing)``), so that the traceback ends in that package's frame and
    the message, not in a helper's frames."""
    missing = [DISTRIBUTIONS.get(module, module) for module in modules if not installed(module)]
    if not missing:
        return None
    verb = "is" if len(missing) == 1 else "are"
    return (f"{needed_by} needs {', '.join(missing)}, which {verb} not installed: "
            f"pip install 'gradreg[{extra}]' (in a checkout: pip install -e '.[{extra}]')")


def require(extra: str, needed_by: str, *modules: str) -> None:
    """Raise an ``ImportError`` with the line of :func:`missing_extra` if one of ``modules`` is
    not installed."""
    missing = missing_extra(extra, needed_by, *modules)
    if missing is not None:
        raise ImportError(missing)
