"""What a run of a sweep is to its sweeper: the value it returns, and whether its failure ends the
search.

A search (the app's Optuna sweeper, :mod:`gradreg.app.sweeps.search`, ``configs/hparams_search/``)
optimizes the value the task function returns: the metric named by ``optimized_metric``
(:func:`objective`). A trial of a search whose training diverges (:class:`~gradreg.NonFiniteError`:
a NaN or Inf penalty, typically at a large weight or learning rate) fails alone: the job raises
:class:`DivergedTrial`, the sweeper records the trial as failed and the study goes on; any other
error ends the search (:func:`fails_trial_only`). A search recipe run without ``-m`` is refused
(:func:`check_search_mode`).
"""

from __future__ import annotations

from collections.abc import Mapping

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from ..checks.errors import ConfigError
from ..invocation import command


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


#: the sweeper of the searches (configs/hydra/sweeper/penalty_search.yaml)
SEARCH_SWEEPER = "hydra_plugins.gradreg_sweepers.search.SearchSweeper"


def in_search() -> bool:
    """Whether this is a job of a search (a multirun of :data:`SEARCH_SWEEPER`)."""
    if not HydraConfig.initialized():
        return False
    hydra = HydraConfig.get()
    return (hydra.mode == RunMode.MULTIRUN
            and str(hydra.sweeper.get("_target_", "")) == SEARCH_SWEEPER)


class DivergedTrial(RuntimeError):
    """A trial of an Optuna search whose training diverged; the study records it as failed."""


def fails_trial_only() -> bool:
    """Whether an error of this job fails only its own trial: a job of a search (which records
    failed trials and goes on). Single runs and grid sweeps stop at the first error."""
    return in_search()


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

