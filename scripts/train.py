"""Train with gradient penalties: ``python scripts/train.py [group=option ...] [key=value ...]``.

Examples::

    python scripts/train.py                                   # digits MLP + double backprop
    python scripts/train.py model=cnn penalty=double_backprop penalty.weight=0.1
    python scripts/train.py experiment=gan_8gaussians_wgan_gp
    python scripts/train.py -m penalty=none,double_backprop   # a sweep, one run per value

Hydra composes ``configs/train.yaml`` with its groups (data, model, penalty, trainer, logger,
callbacks, experiment, debug); this file builds the objects with ``hydra.utils.instantiate`` and
hands them to Lightning. It is the whole app, on purpose: the training logic lives in
:mod:`gradreg.lightning`, and an app module inside the package would make ``gradreg`` import
Hydra, which the layering forbids (the core and the Lightning layer work without Hydra).

The penalties of a run are ``penalty`` (unless ``penalty=none``) plus the ``penalties`` dict,
passed to the model as ``name -> GradientPenalty``.

Errors: a configuration that cannot be built (unknown preset, negative weight, a critic penalty
for a classifier, ``n_critic < 1`` ...) ends the run with exit status 2 and one line on stderr
naming the config key and the valid values; ``HYDRA_FULL_ERROR=1`` shows the traceback instead.
Unknown group options (``penalty=foo``) are Hydra's own error, which lists the options (status 1).
A :class:`~gradreg.GradientError` raised while training (a penalty method the model does not
admit, an op without double backward, a NaN penalty) ends the run the same way, status 2 and one
line.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate

# Lightning exports no public name for the launcher that re-runs the script once per extra rank.
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from omegaconf import DictConfig

# Run from a checkout without installing the package (with `pip install -e .` this changes nothing).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradreg import GradientError


class ConfigError(Exception):
    """A part of the configuration could not be built; the message starts with its key."""


@contextmanager
def building(key: str) -> Iterator[None]:
    """Turn any error raised while building ``key`` into a ConfigError naming ``key``."""
    try:
        yield
    except Exception as error:
        while isinstance(error, InstantiationException) and error.__cause__ is not None:
            error = error.__cause__  # Hydra's wrapper: report what the constructor said
        raise ConfigError(f"{key}: {error}") from error


def build(cfg: DictConfig) -> tuple[L.LightningDataModule, L.LightningModule, L.Trainer]:
    """Data module, model (with its penalties) and trainer of the configuration ``cfg``."""
    with building("data"):
        datamodule = instantiate(cfg.data, _convert_="all")
    nodes = [] if cfg.penalty.name == "none" else [("penalty", cfg.penalty.name, cfg.penalty)]
    nodes += [(f"penalties.{name}", name, node) for name, node in cfg.penalties.items()]
    penalties = {}
    for key, name, node in nodes:
        with building(key):
            penalties[name] = instantiate(node, _convert_="all")
    with building("model"):
        model = instantiate(cfg.model, penalties=penalties, _convert_="all")
    with building("logger"):
        loggers = [instantiate(node) for node in cfg.logger.values()]
    with building("callbacks"):
        # a callback set to null in a config (or `callbacks.<name>=null`) is left out
        callbacks = [instantiate(node) for node in cfg.callbacks.values() if node is not None]
    with building("trainer"):
        trainer = instantiate(cfg.trainer, logger=loggers or False, callbacks=callbacks)
        check_launcher(trainer)
    return datamodule, model, trainer


def check_launcher(trainer: L.Trainer) -> None:
    """Refuse a strategy that re-launches this script per rank inside a Hydra multirun.

    Such a child re-runs the whole sweep (``-m`` is in its command line) with its own timestamped
    output directories; ``ddp_spawn`` starts the ranks as processes of the current job instead.
    """
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if multirun and isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher):
        raise ValueError(
            f"strategy {type(trainer.strategy).__name__} re-launches scripts/train.py for each "
            "extra rank, which inside a multirun (-m) re-runs the whole sweep with its own output "
            "directories; use trainer=ddp_spawn_cpu (the ranks are processes of each job), or run "
            "each job without -m"
        )


def report(trainer: L.Trainer, metrics: dict[str, float], output_dir: Path) -> None:
    """Print the final metrics and where the logs and the checkpoint are; save metrics.json."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    width = max(map(len, metrics), default=0)
    print("\nfinal metrics:")
    for name, value in sorted(metrics.items()):
        print(f"  {name:<{width}}  {value:.4f}")
    log_dir = getattr(trainer.logger, "log_dir", None)  # None without a logger, in fast_dev_run
    checkpoint = trainer.checkpoint_callback and trainer.checkpoint_callback.best_model_path
    print(f"tensorboard logs: {Path(log_dir) if log_dir else '(none)'}")
    print(f"checkpoint:       {checkpoint or '(none)'}")
    print(f"metrics:          {output_dir / 'metrics.json'}")


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> dict[str, Any]:
    L.seed_everything(cfg.seed, workers=True)
    try:
        datamodule, model, trainer = build(cfg)
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        trainer.test(model, datamodule=datamodule, verbose=False)
    except (ConfigError, GradientError) as error:  # ours: say what to change, in one line
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        where = "" if isinstance(error, ConfigError) else "training: "
        print(f"error: {where}{error}  (HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        sys.exit(2)
    metrics |= {name: float(value) for name, value in trainer.callback_metrics.items()}
    if trainer.is_global_zero:  # under DDP, Lightning re-runs this script for the other ranks
        report(trainer, metrics, Path(cfg.paths.output_dir))
    return metrics


if __name__ == "__main__":
    main()
