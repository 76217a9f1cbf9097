"""torchvision, the optional ``vision`` extra, imported with an error that says what to install.

torchvision's compiled operators are built against one torch release: a torchvision wheel next to
another torch build (a CPU-only ``2.13.0+cpu``, or a torch upgraded alone) fails while loading
them (``operator torchvision::nms does not exist``), a ``RuntimeError`` from deep inside its
import. Both that and a missing torchvision become one ``ImportError`` naming the pair to install.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from types import ModuleType

import torch

#: A torch / torchvision pair built for each other (the pair CI tests the image app with).
PAIR = "torch==2.14.1 torchvision==0.29.1"


def import_torchvision(needed_by: str) -> ModuleType:
    """``import torchvision``, or an ``ImportError`` for ``needed_by`` (e.g. ``"model=resnet18"``)
    that names the torch and torchvision releases to install."""
    try:
        return importlib.import_module("torchvision")
    except ImportError as error:
        raise ImportError(
            f"{needed_by} needs torchvision (the vision extra): pip install {PAIR}, then "
            "pip install -e '.[vision]' (or the torchvision release built for your torch)"
        ) from error
    except RuntimeError as error:
        version = metadata.version("torchvision")
        raise ImportError(
            f"{needed_by}: torchvision {version} cannot load with torch {torch.__version__} "
            f"({str(error).splitlines()[0]}); they are not built for each other. Install a "
            f"matching pair, e.g. pip install {PAIR}"
        ) from error
