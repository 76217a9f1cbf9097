"""The values of a composed configuration that a run cannot use, checked before anything is built:
the seed, threads, the trainer's and the data's numbers (:data:`VALUE_RULES`), the learning
rates, the names of the penalties, and the callbacks for the model
(:mod:`~gradreg.app.callback_checks`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from .callback_checks import check_callbacks
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
