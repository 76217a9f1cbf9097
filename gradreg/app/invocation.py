"""How the app was started: the words of its command (for the commands its messages suggest)
and the folder of its config groups."""

from __future__ import annotations

import sys
from pathlib import Path

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
