"""An Optuna study of the app's runs, in a database: the search of ``hparams_search=...``.

The search space is Hydra's sweep syntax (``configs/hparams_search/``'s ``hydra.sweeper.params``
and the command line's sweeps, the command line winning for a key in both):
``tag(log, interval(a, b))`` a float (``tag(int, ...)``: an integer) on a log scale,
``interval(a, b)`` a float, ``choice(x, y, ...)`` and ``range(a, b[, step])`` a categorical; a
plain ``key=value`` is passed to every trial. Each trial is one job of the sweep's launcher (the
sweep's process, ``joblib`` workers, SLURM jobs), numbered as its trial, so its folder is
``<sweep folder>/<trial number>_...``; it returns the value of ``optimized_metric``.

The study lives in ``storage``: a SQLAlchemy URL (``sqlite:///study.db``,
``postgresql://user@host/db``), by default ``sqlite:///<sweep folder>/optuna.db``. Run again
with the same storage (for the default, the same ``hydra.sweep.dir``) it resumes
(:func:`resume`): the finished trials are kept, a trial that was running when the search was
killed is recorded as failed and its parameters are tried again, and the study runs to
``n_trials`` trials in all. ``optuna-dashboard <storage URL>`` shows the study while it runs.

A trial whose training diverged (:class:`~gradreg.app.sweeps.trials.DivergedTrial`) is recorded as
failed and the search goes on, one pruned from its validation metric
(:mod:`gradreg.app.sweeps.pruning`) as pruned; any other error of a trial ends the search.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import (
    ChoiceSweep,
    IntervalSweep,
    Override,
    RangeSweep,
    Transformer,
)
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from ..checks.errors import ConfigError
from .trials import DivergedTrial

#: the default storage's file in the sweep folder
DEFAULT_FILE = "optuna.db"
#: the file where the search leaves its best trial (read by :mod:`gradreg.app.sweeps.search_report`)
RESULTS = "optimization_results.yaml"
#: a trial's user attribute: its run folder
FOLDER = "folder"


def storage_url(storage: str | None, sweep_dir: str | Path) -> str:
    """``storage``, or ``sqlite:///<sweep folder, absolute>/optuna.db`` where None."""
    if storage:
        return str(storage)
    return f"sqlite:///{Path(sweep_dir).resolve() / DEFAULT_FILE}"


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Optuna's storage of ``url``. Raises ConfigError where it cannot be opened (no such
    database or folder, a server that does not answer, a database driver not installed)."""
    try:
        return optuna.storages.RDBStorage(url)
    except Exception as error:  # SQLAlchemy's and the drivers' errors have no common base
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(
            f"hydra.sweeper.storage: cannot open {url}: {reason}; give a SQLAlchemy URL of a "
            "database that can be opened (sqlite:///path/study.db, postgresql://user@host/db) "
            "or null (a SQLite file in the sweep folder)"
        ) from None


def distribution(override: Override) -> optuna.distributions.BaseDistribution | None:
    """Optuna's distribution of a sweep override (module docstring); None for a plain value."""
    if not override.is_sweep_override():
        return None
    value = override.value()
    if isinstance(value, IntervalSweep):
        log = "log" in value.tags
        if "int" in value.tags:
            return optuna.distributions.IntDistribution(int(value.start), int(value.end), log=log)
        return optuna.distributions.FloatDistribution(float(value.start), float(value.end),
                                                      log=log)
    if isinstance(value, ChoiceSweep | RangeSweep):
        return optuna.distributions.CategoricalDistribution(
            list(override.sweep_iterator(transformer=Transformer.encode)))
    raise ConfigError(f"{override.key_or_group}: {override.input_line} is not a search space; "
                      "use tag(log, interval(a, b)), interval(a, b), choice(...) or range(...)")


@dataclass(frozen=True)
class Space:
    """What every trial gets: its distributions (key -> distribution) and the fixed overrides."""

    distributions: dict[str, optuna.distributions.BaseDistribution]
    fixed: list[str]


def search_space(params: Mapping[str, str] | None, arguments: Sequence[str]) -> Space:
    """The space of the recipe's ``params`` and the command line's ``arguments`` (the command
    line wins for a key in both)."""
    lines = {}
    for line in [*(f"{key}={value}" for key, value in (params or {}).items()), *arguments]:
        override = OverridesParser.create().parse_override(line)
        lines[override.get_key_element()] = override
    distributions, fixed = {}, []
    for key, override in lines.items():
        space = distribution(override)
        if space is None:
            fixed.append(f"{key}={override.get_value_element_as_str()}")
        else:
            distributions[key] = space
    if not distributions:
        raise ConfigError("hydra.sweeper.params: the search has no space to search; give one, "
                          "e.g. 'penalty.weight=tag(log, interval(0.001, 10))'")
    return Space(distributions, fixed)


def resume(study: optuna.Study) -> tuple[int, int]:
    """Prepare a study that may have run before: each trial left running (its search was killed)
    is recorded as failed and its parameters queued to be tried again (user attribute
    ``retry_of``: its number). Returns (the trials that ended: complete, pruned or failed, less
    those tried again; the trials queued now)."""
    ended = {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
             optuna.trial.TrialState.FAIL}
    interrupted = [t for t in study.get_trials(deepcopy=False)
                   if t.state == optuna.trial.TrialState.RUNNING]
    for trial in interrupted:
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials} - {None}
    return sum(t.state in ended and t.number not in retried for t in trials), len(interrupted)


#: a batch of jobs: each job's overrides and the number of its first job -> their returns
Launch = Callable[[list[list[str]], int], Sequence[JobReturn]]


def run_trials(study: optuna.Study, space: Space, n_trials: int, n_jobs: int,
               launch: Launch) -> None:
    """Ask, launch and tell until the study holds ``n_trials`` ended trials, ``n_jobs`` at a
    time."""
    done, _ = resume(study)
    while done < n_trials:
        trials = [study.ask(space.distributions) for _ in range(min(n_jobs, n_trials - done))]
        numbers = [trial.number for trial in trials]
        # the jobs are numbered as their trials (their folders: <number>_...); trials of one
        # batch that are not consecutive (a study shared with another search) go one by one
        consecutive = numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        groups = [trials] if consecutive else [[trial] for trial in trials]
        for group in groups:
            try:
                returns = launch([space.fixed + overrides(trial.params) for trial in group],
                                 group[0].number)
            except SystemExit as stop:  # a trial refused (status 2) ends the search, failed;
                if stop.code == 2:  # one stopped by Ctrl-C or SIGTERM is tried again on resume
                    for trial in group:
                        study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            for trial, result in zip(group, returns, strict=True):
                tell(study, trial, result)
        done += len(trials)


def overrides(params: Mapping[str, Any]) -> list[str]:
    """A trial's parameters as overrides (floats in full: they repeat the trial exactly)."""
    return [f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"
            for key, value in params.items()]


def tell(study: optuna.Study, trial: optuna.Trial, result: JobReturn) -> None:
    """Record a trial's end: its value; pruned; failed where its training diverged or it
    returned no finite value. Any other error is raised (it ends the search)."""
    folder = (OmegaConf.select(result.hydra_cfg, "hydra.runtime.output_dir")
              if result.hydra_cfg is not None else None)
    if folder is not None:
        trial.set_user_attr(FOLDER, str(folder))
    if result.status == JobStatus.COMPLETED:
        value = result.return_value
        if value is None or not math.isfinite(float(value)):
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, float(value))
        return
    error = result._return_value  # the job's exception (return_value would raise it)
    if isinstance(error, optuna.TrialPruned):
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    elif isinstance(error, DivergedTrial):
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        raise error


def save_results(study: optuna.Study, sweep_dir: Path) -> None:
    """``optimization_results.yaml`` in the sweep folder: the study's name, its best trial's
    parameters, value, number and run folder; nothing where no trial completed."""
    complete = study.get_trials(deepcopy=False, states=[optuna.trial.TrialState.COMPLETE])
    if not complete:
        return
    best = study.best_trial
    OmegaConf.save(OmegaConf.create({
        "name": study.study_name, "best_params": dict(best.params), "best_value": best.value,
        "best_trial": best.number, "best_folder": best.user_attrs.get(FOLDER)}),
        sweep_dir / RESULTS)
