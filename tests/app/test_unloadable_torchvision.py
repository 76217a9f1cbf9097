"""A torchvision that cannot load with the installed torch (``operator torchvision::nms does not
exist``) stops only the commands that use it, with one line naming the pair; the others train.
Before, Lightning's import of torchmetrics imported it and every command ended in a traceback.

The torchvision here is a package of the test's own, first on ``PYTHONPATH``, with a
distribution's metadata (as pip installs it) and an import that raises as the real mismatch does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import ROOT
from .helpers import TINY, run_script

MISMATCH = "operator torchvision::nms does not exist"


@pytest.fixture
def unloadable_torchvision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A torchvision 0.29.1 whose import raises RuntimeError, first on the path of subprocesses."""
    site = tmp_path / "site"
    (site / "torchvision").mkdir(parents=True)
    (site / "torchvision" / "__init__.py").write_text(f"raise RuntimeError({MISMATCH!r})\n")
    (site / "torchvision-0.29.1.dist-info").mkdir()
    (site / "torchvision-0.29.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.29.1\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    return site


def test_the_default_run_trains(unloadable_torchvision: Path, tmp_path: Path) -> None:
    result = run_script(*TINY, "logger=none", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.json").is_file()


def test_resnet18_stops_with_one_line_naming_the_pair(unloadable_torchvision: Path,
                                                      tmp_path: Path) -> None:
    result = run_script("model=resnet18", "model.input_shape=[1,16,16]",
                        f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith(
        f"error: model: model=resnet18: torchvision 0.29.1 cannot load with torch "
        f"{torch.__version__} ({MISMATCH}); they are not built for each other. "
        "Install a matching pair, e.g. pip install torch==2.14.1 torchvision==0.29.1")
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_hidden_from_imports_and_metadata_once_it_failed(unloadable_torchvision: Path) -> None:
    """After hide_unloadable_torchvision: find_spec returns None, import and metadata say not
    found (what Lightning, torchmetrics and transformers take as absent: transformers calls
    find_spec and does not expect it to raise), and import_torchvision still names the failure."""
    program = """
import importlib.metadata, importlib.util
from gradreg.models.torchvision_import import hide_unloadable_torchvision, import_torchvision
hide_unloadable_torchvision()
import lightning
print(importlib.util.find_spec("torchvision"))
for lookup in (lambda: __import__("torchvision"),
               lambda: importlib.metadata.version("torchvision")):
    try:
        lookup()
    except (ModuleNotFoundError, importlib.metadata.PackageNotFoundError) as error:
        print(type(error).__name__)
try:
    import_torchvision("data=image_folder")
except ImportError as error:
    print(error)
"""
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[:3] == ["None", "ModuleNotFoundError", "PackageNotFoundError"]
    assert lines[3].startswith("data=image_folder: torchvision 0.29.1 cannot load with torch ")
    assert f"({MISMATCH})" in lines[3]
