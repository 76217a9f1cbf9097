"""The training app: Hydra composes a run from the config groups, Lightning trains it.

``gradreg-train [group=option ...] [key=value ...]`` (installed with ``pip install
'gradreg[app]'``) and ``python scripts/train.py ...`` (in a checkout) run :func:`main`. The configs
are the checkout's ``configs/`` folder, shipped inside the package as ``gradreg/app/configs``
(:data:`CONFIGS`, of :mod:`gradreg.app.invocation`).

This is the top layer: nothing in the core or in :mod:`gradreg.lightning` imports it. Importing
this package imports neither Hydra nor Lightning; :func:`main` checks the ``app`` extra first
(one line naming it where a package is missing, status 2), and :mod:`gradreg.app.train` imports
Lightning only to train, so ``--help`` answers without it.
"""

from __future__ import annotations

import sys

from gradreg.app.invocation import CONFIGS, command
from gradreg.extras import require

__all__ = ["CONFIGS", "command", "main"]


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
