"""The report of a search's best trial: at the end of a search, :class:`SearchReport` prints its
best parameters in one line and saves that line in the sweep's folder (``best_trial.txt``, next
to the search's ``optimization_results.yaml``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ..console import say


class SearchReport(Callback):
    """Hydra callback of a sweep. After a search that saved ``optimization_results.yaml`` in the
    sweep folder: print its best parameters and value in one line, with the best trial's run
    folder, and save that line as ``best_trial.txt`` there. Other sweeps: nothing."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results_file = sweep_dir / "optimization_results.yaml"
        if not results_file.is_file():
            return
        results = OmegaConf.load(results_file)
        if "best_params" not in results:  # several objectives: a Pareto front, no single best
            return
        folder = results.get("best_folder")
        line = best_trial_line(results.best_params, results.best_value,
                               config.get("optimized_metric"), config.hydra.sweeper.direction,
                               Path(folder) if folder else trial_folder(sweep_dir,
                                                                         results.best_params))
        say(line)
        (sweep_dir / "best_trial.txt").write_text(line + "\n")


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
