"""``hydra/sweeper=penalty_search`` (the searches of ``configs/hparams_search/``): an Optuna study
of the app's runs in a database (:mod:`gradreg.app.sweeps.search`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


class SearchSweeper(Sweeper):
    """Optuna's ask-and-tell loop over the app's jobs: ``n_trials`` trials in all, ``n_jobs`` at
    a time through the configured launcher, the study ``study_name`` in ``storage`` (null: a
    SQLite file in the sweep folder), sampled by ``sampler``, searching ``params`` and the
    command line's sweeps in the ``direction`` of the value the jobs return. (Hydra builds the
    ``sampler`` and ``pruner`` nodes before it builds the sweeper; the jobs build the pruner of
    their own config.)"""

    def __init__(self, direction: str, study_name: str | None, storage: str | None,
                 n_trials: int, n_jobs: int, sampler: Any, params: Any = None,
                 pruner: Any = None) -> None:
        self.direction, self.study_name, self.storage = direction, study_name, storage
        self.n_trials, self.n_jobs = n_trials, n_jobs
        self.sampler, self.params = sampler, params
        self.config: DictConfig | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        from gradreg.app.checks.errors import ConfigError
        from gradreg.app.console import say
        from gradreg.app.sweeps import search as sweep_search

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        url = sweep_search.storage_url(self.storage, sweep_dir)
        try:
            space = sweep_search.search_space(
                OmegaConf.to_container(self.params) if self.params else None, arguments)
            if self.storage is None:
                sweep_dir.mkdir(parents=True, exist_ok=True)
            storage = sweep_search.open_storage(url)
            study = optuna.create_study(
                study_name=self.study_name, storage=storage, load_if_exists=True,
                sampler=self.sampler, direction=self.direction)
        except (ConfigError, ValueError) as error:  # ValueError: the stored study's direction
            say(f"error: {error}", sys.stderr)
            sys.exit(2)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        done = len(study.get_trials(deepcopy=False))
        say(f"study {study.study_name} in {url}"
            + (f" ({done} trials before, resumed)" if done else "")
            + f"; watch it with: optuna-dashboard {url}")
        sweep_search.run_trials(
            study, space, self.n_trials, self.n_jobs,
            lambda jobs, first: self.launcher.launch(jobs, initial_job_idx=first))
        sweep_search.save_results(study, sweep_dir)
