"""Train with gradient penalties: ``python scripts/train.py [group=option ...] [key=value ...]``.

Examples::

    python scripts/train.py                                   # digits MLP + double backprop
    python scripts/train.py model=cnn penalty=double_backprop penalty.weight=0.1
    python scripts/train.py experiment=gan_8gaussians_wgan_gp
    python scripts/train.py -m penalty=none,double_backprop   # a sweep, one run per value
    python scripts/train.py -m hparams_search=classifier_robustness   # Optuna: weight and lr

Hydra composes ``configs/train.yaml`` with its groups (data, model, penalty, trainer, logger,
callbacks, experiment, hparams_search, debug); this file builds the objects with
``hydra.utils.instantiate`` and hands them to Lightning. It is the whole app, on purpose: the
training logic lives in :mod:`gradreg.lightning`, and an app module inside the package would make
``gradreg`` import Hydra, which the layering forbids (the core and the Lightning layer work
without Hydra).

The penalties of a run are ``penalty`` (unless ``penalty=none``) plus the ``penalties`` dict,
passed to the model as ``name -> GradientPenalty``. The run returns the metric named by
``optimized_metric`` (None without one), the value a sweeper such as Optuna's optimizes
(``scripts/train_app/sweeps.py``).

Errors: a configuration that cannot be built or used (unknown preset, negative weight, a critic
penalty for a classifier, ``n_critic < 1``, ``seed=abc``, ``data.batch_size=0``, an output folder
that cannot be written, a checkpoint that is missing or truncated ...) ends the run before
training with exit status 2 and one line on stderr naming the config key and the valid values;
``HYDRA_FULL_ERROR=1`` shows the traceback instead. The checks and the resume rules live in
``scripts/train_app/``.
Errors Hydra meets before the run that are the user's to fix (an unknown group option or key,
an override or config file that does not parse, a run folder it cannot create) end it the same
way (``train_app.checks.hydra_error``).
A :class:`~gradreg.GradientError` raised while training (a penalty method the model does not
admit, an op without double backward, a NaN penalty) ends the run the same way, status 2 and one
line; in an Optuna search a NaN or Inf penalty fails only its trial, and the study goes on.
A run stopped by ``SIGTERM`` (a cluster's preemption) saves ``checkpoints/last.ckpt``, prints
the command that resumes it in one line and exits with status 143, which also stops a sweep.
"""

from __future__ import annotations

# ruff: noqa: E402 (the imports below the path setup and the torchvision check need both)
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

# Run from a checkout without installing the package (with `pip install -e .` this changes
# nothing), and find the app's own modules (scripts/train_app) however this file is run.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradreg.extras import require
from gradreg.models.torchvision_import import hide_unloadable_torchvision

# Hydra and the lightning extra are the app extra: without them, one line naming it (status 2)
try:
    require("app", "scripts/train.py", "hydra", "lightning", "tensorboard", "sklearn",
            "matplotlib")
except ImportError as missing:
    print(f"error: {missing}", file=sys.stderr)
    sys.exit(2)

# Lightning imports an installed torchvision (through torchmetrics): one that cannot load with
# this torch would end every command, although only model=resnet18 and data=image_folder use it
hide_unloadable_torchvision()

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig
from train_app import hydra_compat, run_names, runtime, sweeps  # noqa: F401 (run_names: folder resolvers)
from train_app.checks import (
    ConfigError,
    building,
    check_overrides,
    check_values,
    check_writable,
    hydra_error,
    resolve_checkpoint,
)
from train_app.resume import (
    ResumedWeights,
    check_fresh_output,
    checkpoint_of,
    exit_preempted,
    weight_overrides,
)

from gradreg import GradientError, NonFiniteError
from gradreg.lightning.checkpoint import CheckpointSaveError, PreemptionCheckpoint


def build(cfg: DictConfig, resuming: bool = False
          ) -> tuple[L.LightningDataModule, L.LightningModule, L.Trainer]:
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
    if resuming:
        explicit = weight_overrides(HydraConfig.get().overrides.task, cfg.penalty.name)
        callbacks.append(ResumedWeights({k: p.weight for k, p in penalties.items()}, explicit))
    if not cfg.trainer.get("fast_dev_run"):  # SIGTERM (preemption) saves where training stands
        callbacks.append(PreemptionCheckpoint(Path(cfg.paths.output_dir, "checkpoints",
                                                   "last.ckpt")))
    with building("trainer"):
        trainer = instantiate(
            cfg.trainer, logger=loggers or False, callbacks=callbacks,
            strategy=runtime.ddp_strategy(cfg.trainer.get("strategy", "auto"),
                                          not model.automatic_optimization,
                                          cfg.data.get("global_batch", False)),
            enable_progress_bar=runtime.progress_bar(cfg.trainer.get("enable_progress_bar")),
            # checkpoints are the callbacks' (callbacks=none: none), not Lightning's default
            enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
            use_distributed_sampler=not cfg.data.get("global_batch", False))
        runtime.check_launcher(trainer)
    if cfg.data.get("global_batch", False):
        with building("data.global_batch"):
            runtime.check_global_batch(trainer, model.penalties)
    return datamodule, model, trainer


def report(trainer: L.Trainer, metrics: dict[str, float], output_dir: Path | None) -> None:
    """Print the final metrics and where the logs and the checkpoint are; save metrics.json in
    ``output_dir`` (None: nothing is written, as in ``debug=fast_dev_run``)."""
    width = max(map(len, metrics), default=0)
    print("\nfinal metrics:")
    for name, value in sorted(metrics.items()):
        print(f"  {name:<{width}}  {value:.4f}")
    if output_dir is None:
        return
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    log_dir = getattr(trainer.logger, "log_dir", None)  # None without a logger
    checkpoint = trainer.checkpoint_callback and trainer.checkpoint_callback.best_model_path
    print(f"tensorboard logs: {Path(log_dir) if log_dir else '(none)'}")
    print(f"checkpoint:       {checkpoint or '(none)'}")
    print(f"metrics:          {output_dir / 'metrics.json'}")


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        sweeps.check_search_mode()
        check_values(cfg)
        fast_dev_run = bool(cfg.trainer.get("fast_dev_run"))
        output_dir = None if fast_dev_run else Path(cfg.paths.output_dir)
        if output_dir is not None:
            check_writable(output_dir)
            check_fresh_output(output_dir, resuming=cfg.get("ckpt_path") is not None)
        ckpt_path = resolve_checkpoint(cfg.get("ckpt_path"), Path(cfg.paths.runs),
                                       Path(cfg.paths.output_dir))
        runtime.configure(cfg.get("threads"))
        L.seed_everything(cfg.seed, workers=True)
        datamodule, model, trainer = build(cfg, resuming=ckpt_path is not None)
        ckpt_path = checkpoint_of(model, ckpt_path, cfg.get("ckpt_path") == "last",
                                  Path(cfg.paths.runs), Path(cfg.paths.output_dir))
        if ckpt_path is not None and trainer.is_global_zero:
            print(f"resuming from {ckpt_path}", flush=True)
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        trainer.test(model, datamodule=datamodule, verbose=False)
        metrics |= {name: float(value) for name, value in trainer.callback_metrics.items()}
        if trainer.is_global_zero:  # under DDP, Lightning re-runs this script for the other ranks
            report(trainer, metrics, output_dir)
        return sweeps.objective(metrics, cfg.optimized_metric)
    except NonFiniteError as error:  # a diverged Optuna trial fails alone; else as below
        if not sweeps.fails_trial_only():
            exit_with(error)
        print(f"error: training diverged, this trial fails and the search goes on: {error}",
              file=sys.stderr, flush=True)
        raise sweeps.DivergedTrial(str(error)) from None
    except SIGTERMException:  # preempted: PreemptionCheckpoint saved the run
        exit_preempted(trainer, HydraConfig.get().overrides.task)
    except (ConfigError, GradientError, CheckpointSaveError) as error:  # say what to do, 1 line
        exit_with(error)


def exit_with(error: ConfigError | GradientError | CheckpointSaveError) -> NoReturn:
    """End the run with status 2 and one line on stderr (``HYDRA_FULL_ERROR=1``: raise)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    where = "" if isinstance(error, ConfigError) else "training: "
    print(f"error: {where}{error}  (HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
    sys.exit(2)


def report_hydra_error(error: BaseException) -> None:
    """End the run as :func:`exit_with` does for an error Hydra meets outside :func:`main` that
    is the user's to fix (an override or config file that does not parse, a run folder it
    cannot create, a SLURM launcher off a cluster); return for the others (Hydra reports them)."""
    config_error = hydra_error(error)
    if config_error is not None:
        exit_with(config_error)


if __name__ == "__main__":
    try:
        sweeps.check_plugins(sys.argv)
        check_overrides(sweeps.command_line_overrides(sys.argv))
    except ConfigError as error:
        exit_with(error)
    with sweeps.jobs_environment(sys.argv), hydra_compat.reporting_errors(report_hydra_error):
        main()
