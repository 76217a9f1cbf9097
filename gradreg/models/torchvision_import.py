"""torchvision, the optional ``vision`` extra, imported with an error that says what to install.

torchvision's compiled operators are built against one torch release: a torchvision wheel next to
another torch build (a CPU-only ``2.13.0+cpu``, or a torch upgraded alone) fails while loading
them (``operator torchvision::nms does not exist``), a ``RuntimeError`` from deep inside its
import. Both that and a missing torchvision become one ``ImportError`` with the command that
installs the torchvision built for the installed torch and keeps that torch (a CPU build stays
one: :func:`matching_install`).

Other libraries import an installed torchvision on their own: Lightning imports torchmetrics,
which imports torchvision wherever its distribution is installed. One that cannot load would then
end every program that imports Lightning, although only the modules that use torchvision need
it. :func:`hide_unloadable_torchvision`, called before Lightning is imported, tries torchvision
once and, where it cannot load, makes it look absent to the others (``import torchvision`` and
its distribution's metadata both say not found), while :func:`import_torchvision` still names the
failure and the command.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterable
from importlib import metadata
from importlib.abc import MetaPathFinder
from importlib.util import find_spec
from types import ModuleType
from typing import Any

import torch

#: PyTorch's wheel index: a torch build with a local version tag (``2.13.0+cpu``,
#: ``2.13.0+cu126``) comes from its folder of that tag, where the same build of torchvision is.
WHEEL_INDEX = "https://download.pytorch.org/whl"
#: A torch release (``2.13.0``), with its build's local tag where it has one (``+cpu``).
_RELEASE = re.compile(r"(?P<major>2)\.(?P<minor>\d+)\.(?P<patch>\d+)(?:\+(?P<build>[\w.]+))?")

#: (torchvision's version, the error of its import) once it was found unable to load
_unloadable: tuple[str, Exception] | None = None


def matching_install(torch_version: str) -> str:
    """The pip command that installs the torchvision release built for torch ``torch_version``
    and keeps that torch: torch 2.y.z and torchvision 0.(y + 15) are built for each other (from
    torch 2.1 on), so pinning the torch release makes pip take the torchvision of that series
    that requires it; a build with a local tag (``+cpu``, ``+cu126``, ``+rocm6.2``) is
    matched from PyTorch's index of that tag (PyPI's Linux torch is the CUDA build: installing
    from PyPI would replace a CPU torch by it). For a torch that is no release (a nightly, a
    source build), the advice to install that torch's own torchvision."""
    release = _RELEASE.fullmatch(torch_version)
    if release is None:
        return f"install the torchvision built for torch {torch_version} (from the same source)"
    torch_pin = f"torch=={release['major']}.{release['minor']}.{release['patch']}"
    command = f"pip install {torch_pin} 'torchvision==0.{int(release['minor']) + 15}.*'"
    return command + (f" --index-url {WHEEL_INDEX}/{release['build']}" if release["build"] else "")


def import_torchvision(needed_by: str) -> ModuleType:
    """``import torchvision``, or an ``ImportError`` for ``needed_by`` (e.g. ``"model=resnet18"``)
    that says how to install the torchvision built for the installed torch
    (:func:`matching_install`)."""
    if _unloadable is not None:
        raise _load_error(needed_by, *_unloadable) from _unloadable[1]
    try:
        return importlib.import_module("torchvision")
    except ModuleNotFoundError as error:
        if error.name not in (None, "torchvision"):  # installed, but a module it needs is not
            raise _load_error(needed_by, _version(), error) from error
        raise ImportError(
            f"{needed_by} needs torchvision (the vision extra), the release built for torch "
            f"{torch.__version__}: {matching_install(torch.__version__)}, then "
            "pip install -e '.[vision]'"
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
        f"({first_line}); they are not built for each other. Install the torchvision built for "
        f"this torch: {matching_install(torch.__version__)}"
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
