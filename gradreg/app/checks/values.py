"""What a run cannot use, checked before anything is built.

* :func:`check_overrides`: the command line's overrides, before Hydra runs them: those that
  would fail inside Hydra (SLURM's launcher off a cluster) or do what the user did not mean (a
  quoted ``~`` in a folder option);
* :func:`check_values`: the values of the composed configuration: the seed, threads, the
  trainer's and the data's numbers (:data:`VALUE_RULES`), the learning rates, the names of the
  penalties, and the callbacks for the model (:func:`check_callbacks`: a dashboard callback made
  for another kind of model, a classifier has no critic and a 2D landscape of an image critic
  means nothing, is refused before training instead of failing in it).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterable
from typing import Any

from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: the largest seed numpy accepts (Lightning seeds numpy with the run's seed)
MAX_SEED = 2**32 - 1


def _is_positive_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


#: key -> (test of the value, what the value must be); checked before anything is built.
VALUE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (lambda v: _is_int(v) and 0 <= v <= MAX_SEED,
             f"an integer from 0 to {MAX_SEED} (numpy's seed range)"),
    "threads": (lambda v: v is None or (_is_int(v) and v >= 1),
                "an integer >= 1 (the run's CPU threads, in every thread pool), or null for "
                "each library's default"),
    "trainer.max_epochs": (lambda v: v is None or (_is_int(v) and v >= 1),
                           "an integer >= 1 (0 would report the untrained model's metrics as "
                           "results; -1, training without end, is not offered: set "
                           "+trainer.max_steps=<N> instead)"),
    "trainer.max_steps": (lambda v: _is_int(v) and (v == -1 or v >= 1),
                          "an integer >= 1, or -1 for no step limit"),
    "data.batch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "trainer.accumulate_grad_batches": (lambda v: _is_int(v) and v >= 1,
                                        "an integer >= 1 (batches per optimizer step)"),
    "trainer.check_val_every_n_epoch": (lambda v: v is None or (_is_int(v) and v >= 1),
                                        "an integer >= 1, or null"),
    # torch scales the gradients by min(1, clip / norm): a negative clip reverses them
    "trainer.gradient_clip_val": (lambda v: v is None or v == 0 or _is_positive_number(v),
                                  "a finite number > 0, or null (0: no clipping)"),
    "data.num_workers": (lambda v: _is_int(v) and v >= 0,
                         "an integer >= 0 (0: batches are loaded in the training process)"),
}


def check_values(cfg: DictConfig) -> None:
    """Raise ConfigError for the first value of :data:`VALUE_RULES` that breaks its rule, for a
    learning rate that is not a finite number > 0 (``model.<any>optimizer.lr``: 0 trains
    nothing, a negative one ascends the loss), for a name given to two penalties, or for a
    callback made for another kind of model."""
    for key, (valid, requirement) in VALUE_RULES.items():
        section, _, name = key.rpartition(".")
        node = cfg.get(section) if section else cfg
        if node is None or name not in node:
            continue
        value = node[name]
        if not valid(value):
            raise ConfigError(f"{key}: must be {requirement}, got {value!r}")
    for name, node in (cfg.get("model") or {}).items():
        if (str(name).endswith("optimizer") and isinstance(node, DictConfig) and "lr" in node
                and not _is_positive_number(node.lr)):
            raise ConfigError(f"model.{name}.lr: must be a finite number > 0 (the optimizer's "
                              f"step size), got {node.lr!r}")
    _check_penalty_names(cfg)
    check_callbacks(cfg)


def _check_penalty_names(cfg: DictConfig) -> None:
    """The model gets ``penalty`` under its preset name and each ``penalties`` entry under its
    key: one name for two penalties would keep one of them and drop the other."""
    main = cfg.penalty.get("name") if cfg.get("penalty") is not None else None
    if main not in (None, "none") and main in (cfg.get("penalties") or {}):
        raise ConfigError(
            f"penalties.{main}: {main} is already the name of penalty={main}, and the model "
            f"takes one penalty per name (one would replace the other); give this one another "
            f"name, e.g. +penalties.{main}_2=..., or set penalty=none"
        )

#: path options that Hydra and the app use as they are written: a ``~`` in them is a folder name
HOME_UNEXPANDED = ("hydra.run.dir", "hydra.sweep.dir", "paths.runs", "paths.sweeps",
                   "paths.output_dir", "paths.scorer")


def check_overrides(overrides: Iterable[Override]) -> None:
    """Raise ConfigError for a command line that would fail inside Hydra or do what the user
    did not mean: SLURM's launcher where this machine has no ``sbatch`` and ``srun`` (not a
    cluster's node: submitit fails with a traceback), or a quoted ``~`` in a folder option of
    :data:`HOME_UNEXPANDED` (the shell does not expand it inside quotes, and a folder named ``~``
    would be created in the working directory)."""
    missing = [command for command in ("sbatch", "srun") if shutil.which(command) is None]
    for override in overrides:
        value = override.value()
        if override.key_or_group == "hydra/launcher" and value == "submitit_slurm" and missing:
            raise ConfigError(
                f"hydra/launcher=submitit_slurm: {' and '.join(missing)} not found on this "
                "machine (this launcher submits jobs to a SLURM cluster from one of its nodes); "
                "here run the jobs with hydra/launcher=submitit_local or hydra/launcher=joblib, "
                "or without a launcher option"
            )
        if (override.key_or_group in HOME_UNEXPANDED and isinstance(value, str)
                and value.startswith("~")):
            raise ConfigError(
                f"{override.key_or_group}={value}: ~ is not expanded here (a folder named ~ would "
                f"be created in the working directory); write {override.key_or_group}="
                f"$HOME{value[1:]}, which the shell expands"
            )

GAN_2D, GAN_IMAGES = "GAN on 2D points", "GAN on images"
#: callbacks made for some kinds of model: class -> (those kinds, how a message names them)
CALLBACK_KINDS: dict[str, tuple[set[str], str]] = {
    "SaliencyMaps": ({"Classifier"}, "a Classifier"),
    "InterpolatesGradientNorm": ({GAN_2D, GAN_IMAGES}, "a GAN"),
    "CriticLandscape": ({GAN_2D}, f"a {GAN_2D}"),
    "SampleGrid": ({GAN_IMAGES}, f"a {GAN_IMAGES}"),
}
#: the callbacks config made for each kind of model
DASHBOARDS = {"Classifier": "dashboards", GAN_2D: "gan_dashboards",
              GAN_IMAGES: "image_gan_dashboards"}


def _model_kind(cfg: DictConfig) -> str | None:
    """Classifier, GAN on 2D points or GAN on images (its data has ``shape``); None for a
    model class of the user's."""
    name = str(cfg.model.get("_target_", "")).rpartition(".")[2]
    if name == "GAN":
        shape = OmegaConf.select(cfg, "data.shape", throw_on_resolution_failure=False)
        return GAN_IMAGES if shape is not None else GAN_2D
    return name if name == "Classifier" else None


def check_callbacks(cfg: DictConfig) -> None:
    """A dashboard callback made for another kind of model fails mid-training (a classifier
    has no critic; a 2D landscape of an image critic means nothing): refuse it up front."""
    kind = _model_kind(cfg)
    for name, node in (cfg.get("callbacks") or {}).items():
        target = str(node.get("_target_", "")) if isinstance(node, DictConfig) else ""
        kinds, described = CALLBACK_KINDS.get(target.rpartition(".")[2], (None, ""))
        if kind is not None and kinds is not None and kind not in kinds:
            raise ConfigError(
                f"callbacks: {target.rpartition('.')[2]} (callbacks.{name}) is for {described}, "
                f"but the model is a {kind}; use callbacks={DASHBOARDS[kind]} (or default, "
                "none)"
            )
