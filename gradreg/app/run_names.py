"""Run folder names: the effective penalty and weight first, and one folder per run.

TensorBoard names a run by its folder (relative to ``--logdir``) and cuts names at about 40
characters in its lists, so a name starts with what tells runs apart in a sweep of penalties:
:func:`penalty_label`, ``double_backprop:0.1`` (the penalty's name and its weight λ as the run
uses it, the defaults included), ``none`` without a penalty. A single run's folder is
``<runs>/<label>_<date>/<time>_<overrides>``; a sweep's job is ``<job>_<label>[_<the other swept
overrides>]`` in ``<sweeps>/<date>/<time>`` (configs/train.yaml), ``<job>`` the job's number
zero-padded to :data:`JOB_DIGITS` digits (:func:`job_id`), so that TensorBoard's lists and its
HParams table (whose Trial ID is the folder) sort the jobs in order.

Two runs started in the same second with the same overrides used to share one folder (their
event files, checkpoints and metrics mixed). :func:`claim_folder` makes the folder of a run (or
of a sweep) with an exclusive ``mkdir`` and, where another process made it first, takes
``<time>-2``, ``<time>-3``, ...; the resolver is cached, so Hydra's later readings of the same
key (and a sweep's jobs, which get a copy of the cache) see the same folder.

The HParams columns that configs/callbacks/hparams.yaml computes name λ the same way (Hydra
instantiates them, as nested ``_target_`` nodes, when it builds the callbacks):

* :func:`effective_weight`: λ as the run uses it, one ``weight`` column for every penalty: 0
  for ``penalty=none``, whatever ``penalty.weight`` the command line gave it (a sweep
  ``penalty=none,double_backprop penalty.weight=0.1,1`` gives ``none`` each weight);
* :func:`log10`: TensorBoard's HParams declaration has no log-scale hint (``HParamInfo`` has a
  name, a type, a domain and whether it differs), so λ and the learning rate also get
  ``weight_log10`` and ``lr_log10`` columns, blank where the value is 0 (``penalty=none``).
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from .sweeps.space import swept_keys

#: the penalty name of a run without a penalty
NO_PENALTY = "none"
#: the overrides a run's label already states
LABELLED_KEYS = ("penalty", "penalty.weight")
#: the digits of a sweep job's number in its folder name (``007_none``): sorted up to 999 jobs
JOB_DIGITS = 3


def short_number(value: str, digits: int = 4) -> str:
    """``value`` with at most ``digits`` significant digits if it is a float written longer
    (``0.15676677195506075`` -> ``0.1568``: a sampler's values in a folder name); else as is."""
    if not any(char in value for char in ".eE"):
        return value
    try:
        number = float(value)
    except ValueError:
        return value
    short = f"{number:.{digits}g}"
    return short if math.isfinite(number) and len(short) < len(value) else value


def job_id(number: Any) -> str:
    """``7`` -> ``007``: a job's number, zero-padded to :data:`JOB_DIGITS` digits."""
    return f"{int(number):0{JOB_DIGITS}d}"


def penalty_label(name: str, weight: Any, penalties: Mapping[str, Any] | None = None) -> str:
    """``double_backprop:0.1``, ``none``, ``r1:10+r2:1`` (with ``penalties``' entries, whose
    ``weight`` is each one's λ): the penalties a run trains with and their weights (a name
    alone where the config has no weight)."""
    named = [] if name == NO_PENALTY else [(name, weight)]
    named += [(key, node.get("weight") if isinstance(node, Mapping) else None)
              for key, node in (penalties or {}).items()]
    return "+".join(key if value is None else f"{key}:{short_number(str(value))}"
                    for key, value in named) or NO_PENALTY


def effective_weight(penalty: str, weight: float | None) -> float:
    """λ as the run uses it: 0 for ``penalty=none`` (which ignores ``penalty.weight``) or
    without a weight, else ``weight``."""
    if penalty == NO_PENALTY or weight is None:
        return 0.0
    return float(weight)


def log10(value: float | None) -> float | None:
    """``log10(value)`` for a positive number; None (a blank cell) for 0, a negative number or
    None."""
    if value is None or float(value) <= 0:
        return None
    return math.log10(float(value))


def run_folder_suffix(overrides: str, only_swept: bool = False, limit: int = 120) -> str:
    """``_<overrides>`` for a run folder, from Hydra's ``override_dirname`` (``key:value`` joined
    by ``+``, configs/train.yaml; sorted by key). ``only_swept``: just the keys the command line
    sweeps (the folder of a sweep's job: what tells it from its siblings; the sweep's own folder
    is the time it started). ``/`` and ``,`` inside values become ``_`` (a folder name, and a
    value ``ckpt_path=`` accepts without quotes), floats longer than 4 significant digits are
    shortened to 4 (a sampler's values); whole overrides past ``limit`` characters are left out
    (``+...``); ``""`` without overrides."""
    safe = overrides.replace("/", "_").replace(",", "_")
    # split at each "+" that joins two overrides, not at the sign of an exponent (lr:1e+20)
    items = [item for item in re.split(r"\+(?![0-9])", safe) if item]
    items = [f"{key}:{short_number(value)}" if sep else key
             for key, sep, value in (item.partition(":") for item in items)]
    if only_swept:
        keys = swept_keys(sys.argv)
        items = [item for item in items if item.split(":", 1)[0] in keys]
    kept = ""
    for item in items:
        if len(kept) + len(item) + 1 > limit:
            return f"_{kept}+..."
        kept = f"{kept}+{item}" if kept else item
    return f"_{kept}" if kept else ""


def other_swept(overrides: str, limit: int = 80) -> str:
    """``_<key:value+...>`` of the swept overrides of a sweep's job that its label does not
    state (``seed:1``, ``model.optimizer.lr:0.001``), as :func:`run_folder_suffix` writes them;
    ``""`` where there are none."""
    items = [item for item in re.split(r"\+(?![0-9])", overrides)
             if item and item.split(":", 1)[0] not in LABELLED_KEYS]
    return run_folder_suffix("+".join(items), only_swept=True, limit=limit)


def claim_folder(base: str, tail: str = "") -> str:
    """``base + tail``, made by this process; ``base-2 + tail``, ``base-3 + tail``, ... where
    another process made it first. Where the parent cannot be written, ``base + tail`` unmade
    (the app's own check then names the folder)."""
    candidate, attempt = Path(base + tail), 1
    try:
        candidate.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                candidate.mkdir()
                return str(candidate)
            except FileExistsError:
                attempt += 1
                candidate = Path(f"{base}-{attempt}{tail}")
    except OSError:
        return base + tail


def run_folder(runs: str, label: str, date: str, time: str, overrides_suffix: str) -> str:
    """``<runs>/<label>_<date>/<time>[-n]<overrides_suffix>``, claimed (:func:`claim_folder`)."""
    return claim_folder(os.path.join(runs, f"{label}_{date}", time), overrides_suffix)


def sweep_folder(sweeps: str, date: str, time: str) -> str:
    """``<sweeps>/<date>/<time>[-n]``, claimed (:func:`claim_folder`)."""
    return claim_folder(os.path.join(sweeps, date, time))


OmegaConf.register_new_resolver("penalty_label", penalty_label, replace=True)
OmegaConf.register_new_resolver("other_swept", other_swept, replace=True)
OmegaConf.register_new_resolver("run_folder", run_folder, replace=True, use_cache=True)
OmegaConf.register_new_resolver("sweep_folder", sweep_folder, replace=True, use_cache=True)
OmegaConf.register_new_resolver("run_folder_suffix", run_folder_suffix, replace=True)
OmegaConf.register_new_resolver("job_id", job_id, replace=True)
