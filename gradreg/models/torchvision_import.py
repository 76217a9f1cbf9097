"""torchvision, the optional ``vision`` extra, imported with an error that says what to install.

torchvision's compiled operators are built against one torch release: a torchvision wheel next to
another torch build (a CPU-only ``2.13.0+cpu``, or a torch upgraded alone) fails while loading
them (``operator torchvision::nms does not exist``), a ``RuntimeError`` from deep inside its
import. Both that and a missing torchvision become one ``ImportError`` naming the pair to install.

Other libraries import an installed torchvision on their own: Lightning imports torchmetrics,
which imports torchvision wherever its distribution is installed. One that cannot load would then
end every program that imports Lightning, although only the modules that use torchvision need
it. :func:`hide_unloadable_torchvision`, called before Lightning is imported, tries torchvision
once and, where it cannot load, makes it look absent to the others (``import torchvision`` and
its distribution's metadata both say not found), while :func:`import_torchvision` still names the
failure and the pair.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from importlib import metadata
from importlib.abc import MetaPathFinder
from importlib.util import find_spec
from types import ModuleType
from typing import Any

import torch

#: A torch / torchvision pair built for each other (the pair CI tests the image app with).
PAIR = "torch==2.14.1 torchvision==0.29.1"
#: Where pip finds that pair as CPU builds (PyPI's Linux wheels of torch are CUDA builds).
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"

#: (torchvision's version, the error of its import) once it was found unable to load
_unloadable: tuple[str, Exception] | None = None


def import_torchvision(needed_by: str) -> ModuleType:
    """``import torchvision``, or an ``ImportError`` for ``needed_by`` (e.g. ``"model=resnet18"``)
    that names the torch and torchvision releases to install."""
    if _unloadable is not None:
        raise _load_error(needed_by, *_unloadable) from _unloadable[1]
    try:
        return importlib.import_module("torchvision")
    except ModuleNotFoundError as error:
        if error.name not in (None, "torchvision"):  # installed, but a module it needs is not
            raise _load_error(needed_by, _version(), error) from error
        raise ImportError(
            f"{needed_by} needs torchvision (the vision extra): pip install {PAIR}, then "
            "pip install -e '.[vision]' (or the torchvision release built for your torch; "
            f"CPU builds of the pair: add {CPU_INDEX})"
        ) from error
    except Exception as error:
        raise _load_error(needed_by, _version(), error) from error


def _version() -> str:
    """The installed torchvision's version, for the messages."""
    try:
        return metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        return "(of no installed distribution)"


def _load_error(needed_by: str, version: str, error: Exception) -> ImportError:
    first_line = (str(error).splitlines() or [type(error).__name__])[0]
    return ImportError(
        f"{needed_by}: torchvision {version} cannot load with torch {torch.__version__} "
        f"({first_line}); they are not built for each other. Install a matching pair, e.g. "
        f"pip install {PAIR} (CPU builds: add {CPU_INDEX})"
    )


def hide_unloadable_torchvision() -> None:
    """Import torchvision if it is installed; where that fails, remember why (for
    :func:`import_torchvision`) and hide it from every later import and metadata lookup of
    this process, so that libraries that use torchvision only where it is available (Lightning,
    torchmetrics) work without it. Nothing changes where torchvision loads or is absent."""
    global _unloadable
    if _unloadable is not None or find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401 (whether it loads is the question)
    except Exception as error:
        _unloadable = (_version(), error)
        for name in [name for name in sys.modules if name.split(".")[0] == "torchvision"]:
            del sys.modules[name]  # the half-imported package and its submodules
        # None in sys.modules: `import torchvision` raises ModuleNotFoundError and
        # importlib.util.find_spec returns None (absent, for Lightning, torchmetrics and
        # transformers alike) instead of raising
        sys.modules["torchvision"] = None  # type: ignore[assignment]
        sys.meta_path.insert(0, _HiddenTorchvision())


class _HiddenTorchvision(MetaPathFinder):
    """A finder that answers "not found" for torchvision's distribution metadata
    (``PackageNotFoundError``: the finders' ``find_distributions`` results are searched in
    order, so raising stops the search before the installed distribution is reached); its
    modules are hidden by ``sys.modules["torchvision"] = None``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        return None  # modules: left to the other finders (torchvision's stop at sys.modules)

    def find_distributions(self, context: Any = None) -> Iterable[metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and name.lower().replace("_", "-") == "torchvision":
            raise metadata.PackageNotFoundError(name)
        return ()
