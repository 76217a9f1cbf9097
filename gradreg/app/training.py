"""A run of the app: build the data, the model with its penalties and the trainer from the
composed configuration, fit, test, report. This is where the app imports Lightning (the
configuration is checked and ``--help`` answered before it, without Lightning)."""

from __future__ import annotations

# ruff: noqa: E402 (Lightning is imported after the torchvision check)
import json
import shlex
import signal
from pathlib import Path

from gradreg.models.torchvision_import import hide_unloadable_torchvision

# Lightning imports an installed torchvision (through torchmetrics): one that cannot load with
# this torch would end every command, although only model=resnet18 and data=image_folder use it
hide_unloadable_torchvision()

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from gradreg.app import runtime, trackers
from gradreg.app.checks.errors import building, discard_folder, exit_with
from gradreg.app.checks.paths import check_writable, resolve_checkpoint
from gradreg.app.console import say
from gradreg.app.resume import (
    ResumedWeights,
    check_fresh_output,
    checkpoint_of,
    exit_stopped,
    stopped_by,
    weight_overrides,
)
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
        trackers.log_config(loggers, cfg)  # MLflow, W&B, CSV: the run's config
    with building("callbacks"):
        # a callback set to null in a config (or `callbacks.<name>=null`) is left out
        callbacks = [instantiate(node) for node in cfg.callbacks.values() if node is not None]
    if resuming:
        explicit = weight_overrides(HydraConfig.get().overrides.task, cfg.penalty.name)
        callbacks.append(ResumedWeights({k: p.weight for k, p in penalties.items()}, explicit))
    callbacks.append(runtime.EndProgressLines())  # a stop's error line starts a line of its own
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


def fit(cfg: DictConfig) -> dict[str, float]:
    """Train and test the run of ``cfg`` (resumed where ``ckpt_path`` says); its final metrics.

    Under DDP, Lightning runs this for every rank; rank 0 reports. A run stopped by ``SIGTERM``
    or Ctrl-C (``SIGINT``) ends here with status 143 or 130, the checkpoint and the command that
    resumes from it; a checkpoint that cannot be saved, with status 2 and one line. A
    ``debug=fast_dev_run`` writes nothing, and the empty folder Hydra made for it is removed
    however it ends."""
    trainer = None
    fast_dev_run = bool(cfg.trainer.get("fast_dev_run"))
    try:
        output_dir = None if fast_dev_run else Path(cfg.paths.output_dir)
        if output_dir is not None:
            check_writable(output_dir)
            check_fresh_output(output_dir, resuming=cfg.get("ckpt_path") is not None)
        ckpt_path = resolve_checkpoint(cfg.get("ckpt_path"), Path(cfg.paths.runs),
                                       Path(cfg.paths.output_dir))
        runtime.configure(cfg.get("threads"))
        L.seed_everything(cfg.seed, workers=True, verbose=False)  # no log line before an error
        datamodule, model, trainer = build(cfg, resuming=ckpt_path is not None)
        ckpt_path = checkpoint_of(model, ckpt_path, cfg.get("ckpt_path") == "last",
                                  Path(cfg.paths.runs), Path(cfg.paths.output_dir))
        if ckpt_path is not None and trainer.is_global_zero:
            say(f"resuming from {ckpt_path}")
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        trainer.test(model, datamodule=datamodule, verbose=False)
        metrics |= {name: float(value) for name, value in trainer.callback_metrics.items()}
        if trainer.is_global_zero:
            report(trainer, metrics, output_dir)
        return metrics
    except SIGTERMException:  # SIGTERM or Ctrl-C in training: PreemptionCheckpoint saved the run
        exit_stopped(trainer, HydraConfig.get().overrides.task)
    except KeyboardInterrupt:  # Ctrl-C before the trainer's fit
        exit_stopped(trainer, HydraConfig.get().overrides.task, signal.SIGINT)
    except SystemExit:  # Lightning's exit after a Ctrl-C outside training's steps (or twice)
        if stopped_by(trainer) != signal.SIGINT:
            raise
        exit_stopped(trainer, HydraConfig.get().overrides.task)
    except CheckpointSaveError as error:
        exit_with(error)
    finally:
        if fast_dev_run:
            discard_folder()


def report(trainer: L.Trainer, metrics: dict[str, float], output_dir: Path | None) -> None:
    """Say the final metrics, where the logs and the checkpoint are and the command that opens
    the TensorBoard logs; save metrics.json in ``output_dir`` (None: nothing is written, as in
    ``debug=fast_dev_run``)."""
    width = max(map(len, metrics), default=0)
    say("\n".join(["\nfinal metrics:", *(f"  {name:<{width}}  {value:.4f}"
                                          for name, value in sorted(metrics.items()))]))
    if output_dir is None:
        return
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    log_dir = next((Path(logger.log_dir) for logger in trainer.loggers
                    if isinstance(logger, TensorBoardLogger)), None)  # None: logger=none
    checkpoint = trainer.checkpoint_callback and trainer.checkpoint_callback.best_model_path
    say(f"tensorboard logs: {log_dir or '(none)'}\n"
        f"checkpoint:       {checkpoint or '(none)'}\n"
        f"metrics:          {output_dir / 'metrics.json'}")
    if log_dir:
        say(f"open the logs:    tensorboard --logdir {shlex.quote(str(log_dir))}")
