"""The training app: Hydra composes a run from the config groups, Lightning trains it.

``gradreg-train [group=option ...] [key=value ...]`` (installed with ``pip install
'gradreg[app]'``) and ``python scripts/train.py ...`` (in a checkout) run :func:`main`. The configs
are the checkout's ``configs/`` folder, shipped inside the package as ``gradreg/app/configs``
(:data:`CONFIGS`).

This is the top layer: nothing in the core or in :mod:`gradreg.lightning` imports it. Importing
this package imports neither Hydra nor Lightning; :func:`main` checks the ``app`` extra first
(one line naming it where a package is missing, status 2), and :mod:`gradreg.app.train` imports
Lightning only to train, so ``--help`` answers without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gradreg.extras import require

__all__ = ["CONFIGS", "command", "main"]

#: The config groups: the copy an installed package ships, else the checkout's configs/ (a
#: checkout, or an editable install of one, has no gradreg/app/configs).
CONFIGS = (Path(__file__).with_name("configs") if Path(__file__).with_name("configs").is_dir()
           else Path(__file__).resolve().parents[2] / "configs")


def command() -> list[str]:
    """The words that started the app, for the commands its messages suggest:
    ``["gradreg-train"]`` for the console command, ``["python", "scripts/train.py"]`` else."""
    if Path(sys.argv[0]).name == "gradreg-train":
        return ["gradreg-train"]
    return ["python", "scripts/train.py"]


def main() -> None:
    """Run the app on the command line's arguments (the console command ``gradreg-train``)."""
    try:
        require("app", " ".join(command()), "hydra", "lightning", "tensorboard", "sklearn",
                "matplotlib")
    except ImportError as missing:
        print(f"error: {missing}", file=sys.stderr)
        sys.exit(2)
    from gradreg.app.train import run

    run()
