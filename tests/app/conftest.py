"""Helpers for the tests of the app: compose configs, load and run scripts/train.py."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
SCRIPT = ROOT / "scripts" / "train.py"
# keep Hydra from configuring logging or writing .hydra/ in in-process runs
QUIET = ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


def options(group: str) -> list[str]:
    """The options of a config group: the yaml files in configs/<group>/."""
    return sorted(path.stem for path in (CONFIGS / group).glob("*.yaml"))


def compose_config(overrides: list[str], output_dir: Path) -> DictConfig:
    """configs/train.yaml with ``overrides``, composed as ``scripts/train.py`` would."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=[f"paths.output_dir={output_dir}", *overrides])
