"""Every example command ``gradreg-train --help`` prints runs: the examples are read from the
help text itself and run as ``python scripts/train.py`` (the same arguments), with a training
budget of a few batches and the run folders in a temporary folder appended."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .helpers import TINY, run_script

#: an example line of the help: two spaces, the command, then a description after two spaces
EXAMPLE = re.compile(r"^  gradreg-train(?P<arguments>(?: +\S+)*?)(?:  +.*)?$", re.MULTILINE)


def help_examples(text: str) -> list[list[str]]:
    """The arguments of each example command of the help ``text``, in order."""
    return [match["arguments"].split() for match in EXAMPLE.finditer(text)]


def test_the_examples_are_read_from_the_help_text() -> None:
    text = ("Usage: gradreg-train [group=option ...]\n"
            "       gradreg-train -m key=a,b ...        (a sweep)\n"
            "  gradreg-train                             digits MLP\n"
            "  gradreg-train model=cnn penalty.weight=0.1\n"
            "  gradreg-train ckpt_path=last              resume the newest run\n")
    assert help_examples(text) == [[], ["model=cnn", "penalty.weight=0.1"], ["ckpt_path=last"]]


@pytest.mark.slow
def test_every_example_of_the_help_runs(tmp_path: Path) -> None:
    """The examples, in the order the help prints them (``ckpt_path=last`` resumes a run of an
    earlier one), each exit with status 0 and report their final metrics (a sweep, each job's)."""
    shown = run_script("--help")
    assert shown.returncode == 0, shown.stderr
    examples = help_examples(shown.stdout)
    assert len(examples) == 5, shown.stdout
    folders = [f"paths.runs={tmp_path / 'runs'}", f"paths.sweeps={tmp_path / 'sweeps'}"]
    for arguments in examples:
        result = run_script(*arguments, *TINY, *folders)
        assert result.returncode == 0, (arguments, result.stderr[-3000:])
        runs = 4 if "-m" in arguments else 1  # penalty=none,double_backprop seed=0,1
        assert result.stdout.count("final metrics:") == runs, (arguments, result.stdout[-3000:])
