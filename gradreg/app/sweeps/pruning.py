"""Pruning a search's hopeless trials from their validation metric.

In a job of a search (``hydra/sweeper=penalty_search``, :mod:`gradreg.app.sweeps.search`),
:class:`TrialPruning` reports ``optimized_metric`` to the trial after each validation (step: the
epoch) and asks the study's pruner (``hydra.sweeper.pruner``, Optuna's ``MedianPruner`` by
default) whether to go on; where not, it says so in one line and raises ``optuna.TrialPruned``,
which ends the job and the sweeper records the trial as pruned. The job finds its trial from its
Hydra config: the study's storage and name, and its job number (the trial's number). Outside a
search, with no such metric logged yet, or under DDP (each rank would decide on its own), it
does nothing.
"""

from __future__ import annotations

import lightning as L
import optuna
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

from ..console import say
from .search import storage_url
from .trials import in_search


def job_trial() -> optuna.Trial | None:
    """The trial this job runs, in its study's storage; None outside a search's job."""
    if not in_search():
        return None
    hydra = HydraConfig.get()
    storage = optuna.storages.get_storage(storage_url(hydra.sweeper.storage, hydra.sweep.dir))
    pruner = hydra.sweeper.get("pruner")
    study = optuna.load_study(study_name=hydra.sweeper.study_name, storage=storage,
                              pruner=instantiate(pruner) if pruner is not None else None)
    trial_id = storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(study.study_name), hydra.job.num)
    return optuna.Trial(study, trial_id)


class TrialPruning(L.Callback):
    """Report ``metric`` after each validation; stop a trial the pruner prunes (module
    docstring)."""

    def __init__(self, metric: str | None) -> None:
        self.metric = metric
        self._trial: optuna.Trial | None = None
        self._searched = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # several processes (DDP) would each report and decide: no pruning there
        if trainer.sanity_checking or self.metric is None or trainer.world_size > 1:
            return
        if not self._searched:
            self._trial, self._searched = job_trial(), True
        value = trainer.callback_metrics.get(self.metric)
        if self._trial is None or value is None:
            return
        self._trial.report(float(value), step=trainer.current_epoch)
        if self._trial.should_prune():
            message = (f"trial {self._trial.number} pruned after epoch {trainer.current_epoch}: "
                       f"{self.metric}={float(value):.4f}")
            if trainer.is_global_zero:
                say(message)
            raise optuna.TrialPruned(message)
