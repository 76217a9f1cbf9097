"""Sweeps: what a run returns to a sweeper, what jobs in other processes need, and the report of
a search's best trial.

A sweeper (Hydra's Optuna sweeper, ``configs/hparams_search/``) optimizes the value the task
function returns: the metric named by ``optimized_metric`` (:func:`objective`). Launchers that
run each job in a process of its own (``hydra/launcher=joblib``, ``submitit_local``,
``submitit_slurm``) unpickle the task function there, which imports this package: from a
checkout, the jobs get its root on their ``PYTHONPATH`` (an installed package needs nothing),
and the keys the command line sweeps (which name each job's
folder, :func:`swept_keys`) in ``GRADREG_SWEPT_KEYS`` (:func:`jobs_environment`). At the end of
a search :class:`SearchReport` prints its best parameters in one line and saves that line in the
sweep's folder (``best_trial.txt``, next to the sweeper's ``optimization_results.yaml``). At
the end of every sweep :class:`SweepSummary` writes ``summary.md`` there (and prints it): one row
per setting of the swept keys, each metric's mean ± standard deviation over its seeds, the best
value of each metric in bold.

A trial of an Optuna search whose training diverges (:class:`~gradreg.NonFiniteError`: a NaN or
Inf penalty, typically at a large weight or learning rate) fails alone: the job raises
:class:`DivergedTrial`, the sweeper records the trial as failed (``max_failure_rate: 1.0`` in
``configs/hydra/sweeper/penalty_search.yaml``) and the study goes on; any other error ends the
search (:func:`fails_trial_only`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .checks import ConfigError
from .console import say
from .hydra_compat import command_line_parser
from .invocation import command
from .sweep_results import job_number

#: the environment variable that hands the swept keys to jobs in other processes
SWEPT_KEYS_VARIABLE = "GRADREG_SWEPT_KEYS"
#: the folder that holds the gradreg package the app runs from
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def objective(metrics: Mapping[str, float], name: str | None) -> float | None:
    """The value of metric ``name`` (what a sweeper optimizes); None without a name.

    Raises ConfigError naming the metrics the run logged where it logged no ``name`` (a typo
    would otherwise end the search with the sweeper's "Return value must be float-castable")."""
    if name is None:
        return None
    if name not in metrics:
        raise ConfigError(
            f"optimized_metric: the run logged no metric {name!r}; it logged "
            f"{sorted(metrics)}, e.g. optimized_metric=val/acc_pgd"
        )
    return metrics[name]


class DivergedTrial(RuntimeError):
    """A trial of an Optuna search whose training diverged; the study records it as failed."""


def fails_trial_only() -> bool:
    """Whether an error of this job fails only its own trial: a job of an Optuna search (which
    records failed trials and goes on). Single runs and grid sweeps stop at the first error."""
    hydra = HydraConfig.get()
    return (hydra.mode == RunMode.MULTIRUN
            and "optuna" in str(hydra.sweeper.get("_target_", "")).lower())


def check_search_mode() -> None:
    """Raise ConfigError where a search recipe (``hparams_search=...``) is run without ``-m``:
    it would train once, with the config's own values, and search nothing."""
    if not HydraConfig.initialized():
        return
    hydra_config = HydraConfig.get()
    recipe = hydra_config.runtime.choices.get("hparams_search")
    if recipe is not None and hydra_config.mode == RunMode.RUN:
        raise ConfigError(
            f"hparams_search: {recipe} is a search of several runs, which Hydra starts with -m: "
            f"{' '.join(command())} -m hparams_search={recipe}"
        )


#: (config group, option prefix) -> the plugin module that provides it, all of the sweeps extra
PLUGINS = {("hparams_search", ""): "hydra_plugins.hydra_optuna_sweeper",
           ("hydra/sweeper", "optuna"): "hydra_plugins.hydra_optuna_sweeper",
           ("hydra/launcher", "joblib"): "hydra_plugins.hydra_joblib_launcher",
           ("hydra/launcher", "submitit"): "hydra_plugins.hydra_submitit_launcher"}


def plugin_installed(module: str) -> bool:
    """Whether the Hydra plugin module ``module`` (``hydra_plugins.<name>``) is installed; False
    too where no Hydra plugin is (no ``hydra_plugins`` package to search in)."""
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def check_plugins(argv: list[str]) -> None:
    """Raise ConfigError where the command line selects a sweeper or launcher whose Hydra plugin
    is not installed (Hydra would say "Could not find 'hydra/sweeper/optuna'")."""
    for override in command_line_overrides(argv):
        value = override.value() if isinstance(override.value(), str) else ""
        for (group, prefix), plugin in PLUGINS.items():
            if (override.key_or_group == group and value.startswith(prefix)
                    and not plugin_installed(plugin)):
                package = plugin.split(".")[1].replace("_", "-")
                raise ConfigError(
                    f"{group}={value} needs Hydra's plugin {package}, of the sweeps extra: "
                    "pip install -e '.[sweeps]'"
                )


def command_line_overrides(argv: list[str]) -> list[Override]:
    """The overrides of a command line, read with Hydra's own argument parser (flags such as
    ``--cfg job`` are not overrides); none where they do not parse (Hydra itself then says
    why)."""
    args, _ = command_line_parser().parse_known_args(argv[1:])
    try:
        return OverridesParser.create().parse_overrides(args.overrides)
    except OverrideParseException:
        return []


def command_line_sweeps(argv: list[str]) -> set[str]:
    """The keys a multirun command line sweeps (``penalty=none,double_backprop``,
    ``seed=range(3)``, ``experiment=glob(*)``, ``penalty.weight=interval(0.01,1)``)."""
    return {override.key_or_group for override in command_line_overrides(argv)
            if override.is_sweep_override()}


def swept_keys(argv: list[str]) -> set[str]:
    """The keys a sweep varies, as Hydra's ``override_dirname`` writes them: those its command
    line sweeps (from ``GRADREG_SWEPT_KEYS`` in a job of another process, from ``argv`` in the
    process that parsed it) and the sweeper's search space (``hydra.sweeper.params``)."""
    exported = os.environ.get(SWEPT_KEYS_VARIABLE)
    keys = set(exported.split(",")) - {""} if exported is not None else command_line_sweeps(argv)
    if HydraConfig.initialized():
        keys |= set(HydraConfig.get().sweeper.get("params") or {})
    return keys


@contextmanager
def jobs_environment(argv: list[str]) -> Iterator[None]:
    """While the app runs: the environment its jobs inherit in processes of their own (a
    checkout's root first on ``PYTHONPATH``, so that they import the same gradreg; the command
    line's swept keys); restored after."""
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", SWEPT_KEYS_VARIABLE)}
    if (PACKAGE_ROOT / "pyproject.toml").is_file():  # a checkout, not site-packages
        paths = [str(PACKAGE_ROOT)] + [p for p in [saved["PYTHONPATH"]] if p]
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    os.environ[SWEPT_KEYS_VARIABLE] = ",".join(sorted(command_line_sweeps(argv)))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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


def job_results(sweep_dir: Path) -> list[tuple[dict[str, str], dict[str, float] | None]]:
    """Each job of a sweep, in job order: its overrides (``.hydra/overrides.yaml``) and its
    ``metrics.json`` (None where the job saved none: it failed or diverged)."""
    jobs = []
    for overrides_file in sorted(sweep_dir.glob("*/.hydra/overrides.yaml"),
                                 key=lambda path: job_number(path.parents[1].name)):
        overrides = dict(item.split("=", 1) for item in OmegaConf.load(overrides_file))
        metrics_file = overrides_file.parents[1] / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else None
        jobs.append((overrides, metrics))
    return jobs
