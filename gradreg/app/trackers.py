"""The experiment trackers of ``logger=mlflow`` and ``logger=wandb`` (the trackers extra):
Lightning's loggers, named after the run's folder, checked before training, and given the run's
config and the sweep's summary.

* :class:`MLflowRun`: Lightning's ``MLFlowLogger`` on ``tracking_uri`` (default
  ``MLFLOW_TRACKING_URI``, else :data:`LOCAL_STORE`, a SQLite file in the working folder; a
  SQLite store's artifacts go to ``mlruns/`` beside its file; ``mlflow ui --backend-store-uri sqlite:///mlflow.db``
  shows them). A run's experiment is ``gradreg``; the jobs of a sweep share the experiment
  ``gradreg <sweep folder>`` (:func:`experiment_of`). A server that does not answer, or a
  store that cannot be opened, is refused before training.
* :class:`WandbRun`: Lightning's ``WandbLogger``, offline by default (the run's files in
  ``<run folder>/wandb/``; ``wandb sync`` uploads them); a sweep's jobs share its group.
  Online (``offline=false``), a W&B server that does not answer is refused before training.

:func:`log_config` gives every such logger (and ``logger=csv``'s) the run's configuration as
hyperparameters; the dashboards' figures reach them through
:mod:`gradreg.lightning.dashboards.artifacts`; :func:`log_sweep_summary` adds a sweep's
``summary.md`` and figure as a run ``summary`` of the sweep.
"""

from __future__ import annotations

import html
import os
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from omegaconf import DictConfig, OmegaConf

from .checks.errors import ConfigError

#: the default MLflow tracking store: a SQLite file in the working folder
LOCAL_STORE = "sqlite:///mlflow.db"
#: the experiment (MLflow) and project (W&B) of the app's runs
PROJECT = "gradreg"
#: the W&B server an online run talks to, unless WANDB_BASE_URL says another
WANDB_SERVER = "https://api.wandb.ai"
#: the config nodes a run's hyperparameters come from
CONFIG_NODES = ("seed", "penalty", "penalties", "model", "data", "trainer", "optimized_metric")
#: seconds to wait for a tracking server's answer before training
TIMEOUT = 5


def sweep_name() -> str | None:
    """``2026-11-29/04-10-00``: the sweep folder's last two parts in a job of a sweep; None in a
    single run (or outside Hydra)."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return "/".join(Path(HydraConfig.get().sweep.dir).parts[-2:])


def run_name() -> str | None:
    """The run's folder name (its TensorBoard run name); None outside Hydra."""
    if not HydraConfig.initialized():
        return None
    return Path(HydraConfig.get().runtime.output_dir).name


def experiment_of(sweep: str | None) -> str:
    """``gradreg`` for a single run, ``gradreg <date>/<time>`` for the jobs of a sweep."""
    return PROJECT if sweep is None else f"{PROJECT} {sweep}"


def check_server(url: str, key: str, fix: str) -> None:
    """Raise ConfigError where the HTTP server ``url`` does not answer within :data:`TIMEOUT`
    seconds (any HTTP answer counts)."""
    try:
        urllib.request.urlopen(url, timeout=TIMEOUT).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise ConfigError(f"{key}: cannot reach {url}: {reason}; {fix}") from None


class MLflowRun(MLFlowLogger):
    """Lightning's ``MLFlowLogger`` for the app (module docstring): the store checked and the
    run created at once, so that a store that cannot be used is refused before training."""

    def __init__(self, tracking_uri: str | None = None, experiment_name: str | None = None,
                 **kwargs: Any) -> None:
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or LOCAL_STORE
        if uri.startswith(("http://", "https://")):
            check_server(uri, "mlflow.tracking_uri",
                         "start the server (mlflow server --port 5000) or leave tracking_uri "
                         f"unset for the local store ({LOCAL_STORE})")
        sweep = sweep_name()
        tags = {"gradreg.folder": str(HydraConfig.get().runtime.output_dir)
                if HydraConfig.initialized() else ""}
        if sweep is not None:
            tags["gradreg.sweep"] = sweep
        if uri.startswith("sqlite:///") and "artifact_location" not in kwargs:
            # a new experiment's artifacts beside its SQLite file (MLflow's default: ./mlruns)
            kwargs["artifact_location"] = str(Path(uri.removeprefix("sqlite:///")).resolve()
                                              .parent / "mlruns")
        super().__init__(experiment_name=experiment_name or experiment_of(sweep),
                         run_name=run_name(), tracking_uri=uri, tags=tags, **kwargs)
        try:
            _ = self.experiment, self.run_id  # the store opened, the run created
        except Exception as error:  # the store's errors have no common base
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ConfigError(
                f"mlflow.tracking_uri: cannot open {uri}: {reason}; give a tracking store that "
                f"can be opened, or leave tracking_uri unset for the local one ({LOCAL_STORE})"
            ) from None


class WandbRun(WandbLogger):
    """Lightning's ``WandbLogger`` for the app (module docstring): offline unless told, named
    after the run's folder, a sweep's jobs in its group."""

    def __init__(self, offline: bool = True, project: str = PROJECT, **kwargs: Any) -> None:
        if not offline:
            check_server(os.environ.get("WANDB_BASE_URL", WANDB_SERVER), "wandb.offline=false",
                         "log offline (logger=wandb, then wandb sync <run folder>/wandb/"
                         "offline-run-*) or check the network and WANDB_BASE_URL")
        import wandb

        if wandb.run is not None:  # the previous job's run, in a sweep's process: ended here
            wandb.run.finish()  # (Lightning's logger would go on logging into it)
        sweep = sweep_name()
        super().__init__(name=run_name(), project=project, offline=offline,
                         group=experiment_of(sweep) if sweep else None, **kwargs)


def flat_config(cfg: DictConfig) -> dict[str, Any]:
    """The run's hyperparameters: the nodes :data:`CONFIG_NODES` of ``cfg``, resolved and
    flattened to ``model.optimizer.lr``-style keys (lists as their text)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            if not node and prefix:
                flat[prefix] = "{}"
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            flat[prefix] = node if node is None or isinstance(node, bool | int | float | str) \
                else str(node)

    container = OmegaConf.to_container(cfg, resolve=True)
    walk("", {key: container[key] for key in CONFIG_NODES if key in container})
    return flat


def log_config(loggers: Iterable[Logger], cfg: DictConfig) -> None:
    """Give every logger but TensorBoard's (whose HParams table has its own columns,
    ``callbacks=hparams``) the run's configuration as hyperparameters (:func:`flat_config`)."""
    trackers = [logger for logger in loggers if not isinstance(logger, TensorBoardLogger)]
    if trackers:
        params = flat_config(cfg)
        for logger in trackers:
            logger.log_hyperparams(params)


def log_sweep_summary(config: DictConfig, sweep_dir: Path, summary: Path,
                      figures: Sequence[Path]) -> None:
    """A run ``summary`` of the sweep in each tracker its jobs logged to (``config.logger``,
    the sweep's own config): MLflow, in the sweep's experiment, with ``summary.md`` and the
    ``figures`` (PNG files) as artifacts; W&B (offline, in the sweep's group, its files in
    ``<sweep folder>/wandb/``), with the summary as text and each figure as an image
    (``sweep/<file name without .png>``)."""
    kinds = {str(node.get("_target_", "")).rpartition(".")[2]
             for node in (config.get("logger") or {}).values() if node is not None}
    sweep = "/".join(sweep_dir.parts[-2:])
    files = [summary, *figures]
    if MLflowRun.__name__ in kinds:
        node = next(n for n in config.logger.values() if str(n.get("_target_", "")).endswith(
            MLflowRun.__name__))
        import mlflow

        client = mlflow.MlflowClient(node.get("tracking_uri") or os.environ.get(
            "MLFLOW_TRACKING_URI") or LOCAL_STORE)
        name = node.get("experiment_name") or experiment_of(sweep)
        found = client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else client.create_experiment(name)
        run = client.create_run(experiment, run_name="summary", tags={"gradreg.sweep": sweep})
        for path in files:
            client.log_artifact(run.info.run_id, str(path))
        client.set_terminated(run.info.run_id)
    if WandbRun.__name__ in kinds:
        node = next(n for n in config.logger.values() if str(n.get("_target_", "")).endswith(
            WandbRun.__name__))
        import wandb

        if wandb.run is not None:  # the last job's
            wandb.run.finish()
        run = wandb.init(project=node.get("project") or PROJECT, name="summary",
                         group=experiment_of(sweep), dir=str(sweep_dir),
                         mode="offline" if node.get("offline", True) else "online")
        logged: dict[str, Any] = {"sweep/summary": wandb.Html(
            f"<pre>{html.escape(summary.read_text())}</pre>")}
        for figure in figures:
            logged[f"sweep/{figure.stem}"] = wandb.Image(str(figure))
        run.log(logged)
        run.finish()
