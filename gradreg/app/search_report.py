"""The report of a search's best trial: at the end of a search, :class:`SearchReport` prints its
best parameters in one line and saves that line in the sweep's folder (``best_trial.txt``, next
to the sweeper's ``optimization_results.yaml``); before it, a database storage the installed
Optuna cannot open is refused."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from .console import say
from .errors import ConfigError


class SearchReport(Callback):
    """Hydra callback of a sweep. Before it: refuse a database ``hydra.sweeper.storage`` that the
    installed Optuna cannot open. After a search whose sweeper saved
    ``optimization_results.yaml`` in the sweep folder: print its best parameters and value in
    one line, with the best trial's run folder, and save that line as ``best_trial.txt`` there.
    Other sweeps: nothing."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_storage(config.hydra.sweeper.get("storage"))
        except ConfigError as error:  # Hydra turns a callback's exceptions into warnings
            say(f"error: {error}", sys.stderr)
            sys.exit(2)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results_file = sweep_dir / "optimization_results.yaml"
        if not results_file.is_file():
            return
        results = OmegaConf.load(results_file)
        if "best_params" not in results:  # several objectives: a Pareto front, no single best
            return
        line = best_trial_line(results.best_params, results.best_value,
                               config.get("optimized_metric"), config.hydra.sweeper.direction,
                               trial_folder(sweep_dir, results.best_params))
        say(line)
        (sweep_dir / "best_trial.txt").write_text(line + "\n")


def check_storage(storage: str | None) -> None:
    """Raise ConfigError for a database storage where Optuna 2 (the only Optuna that Hydra's
    Optuna sweeper accepts) meets SQLAlchemy 2, which it cannot use (an AssertionError when the
    study is created)."""
    if storage is None:
        return
    optuna_major = int(metadata.version("optuna").split(".")[0])
    sqlalchemy_major = int(metadata.version("sqlalchemy").split(".")[0])
    if optuna_major < 3 and sqlalchemy_major >= 2:
        raise ConfigError(
            f"hydra.sweeper.storage: optuna {metadata.version('optuna')} cannot open a database "
            f"with SQLAlchemy {metadata.version('sqlalchemy')}; keep hydra.sweeper.storage=null "
            "(the study in memory: each trial's folder keeps its metrics.json, the sweep folder "
            "the best trial)"
        )


def best_trial_line(params: Mapping[str, Any], value: float, metric: str | None,
                    direction: Any, folder: Path | None) -> str:
    """``best trial: penalty.weight=0.157 model.optimizer.lr=0.00269 -> val/acc_pgd=0.8125
    (maximize), multirun/<date>/<time>/2_<...>``: the overrides that repeat it, then its value."""
    overrides = " ".join(f"{key}={chosen}" for key, chosen in params.items())
    where = f", {folder}" if folder is not None else ""
    return f"best trial: {overrides} -> {metric or 'value'}={value:.4f} ({direction}){where}"


def trial_folder(sweep_dir: Path, params: Mapping[str, Any]) -> Path | None:
    """The run folder of the trial run with ``params`` (read from each job's
    ``.hydra/overrides.yaml``); None where no folder has them (``hydra.output_subdir=null``)."""
    for overrides_file in sorted(sweep_dir.glob("*/.hydra/overrides.yaml")):
        given = dict(item.split("=", 1) for item in OmegaConf.load(overrides_file))
        if all(key in given and _same(given[key], value) for key, value in params.items()):
            return overrides_file.parents[1]
    return None


def _same(text: str, value: Any) -> bool:
    """Whether the override text ``text`` gives ``value`` (floats compared as floats)."""
    if isinstance(value, float):
        try:
            return float(text) == value
        except ValueError:
            return False
    return text == str(value)
