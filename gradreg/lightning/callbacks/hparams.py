"""Log a run's hyperparameters and name its metrics, for TensorBoard's HParams tab.

A sweep (say, penalty weight against clean and FGSM accuracy) is then compared run by run in one
table. TensorBoard's HParams plugin reads, per run, a summary of the hyperparameter values, and
takes its columns from ONE run's experiment summary (the first it finds) for the whole log folder;
each metric's value is the latest scalar under the metric's own tag. So the callback writes, once
per run directory at the start of fit (or test):

* the values: the module's ``hparams`` (``save_hyperparameters``), the weight of every
  :class:`~gradreg.penalties.GradientPenalty` submodule at the start as
  ``penalty/weight/<module path>`` (the name of its weight's tag), and the ``hparams`` given
  here (e.g. a flattened config);
* the experiment: a column for each of those and for each name in ``columns``, and the metric
  tags ``metrics``. Runs of different module kinds in one log folder keep their columns when
  every run declares the same ``hparams`` keys and ``metrics`` (the app's configs do);
* ``columns`` are marked as the ones that differ between runs, which TensorBoard shows first and
  by default (its first five).

The metrics are the module's own tags (``val/acc``, ``test/acc_fgsm``), so nothing is logged
twice; a metric a run never logs is blank in its row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from tensorboard.plugins.hparams import plugin_data_pb2
from torch.utils.tensorboard.summary import hparams as hparams_summaries

from gradreg.lightning.callbacks._logging import tensorboard, warn_without_tensorboard
from gradreg.lightning.callbacks._penalties import penalty_weights
from gradreg.lightning.compat import event_file_writer
from gradreg.lightning.dashboards import PENALTY_WEIGHT

Value = bool | int | float | str


def tensorboard_values(params: Mapping[str, Any], prefix: str = "") -> dict[str, Value]:
    """Nested mappings flattened to ``outer/inner`` keys; other values TensorBoard cannot show
    (``None``, lists, objects) become their ``str``."""
    flat: dict[str, Value] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat.update(tensorboard_values(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, Value) else str(value)
    return flat


class HParamsLogger(pl.Callback):
    """Declare hyperparameters, default columns and metric tags at the start of fit or test.

    Args:
        metrics: scalar tags to compare runs by (e.g. ``["val/acc", "test/acc_fgsm"]``); the
            table shows each one's latest value.
        hparams: extra hyperparameters (e.g. a flattened experiment config).
        columns: the hyperparameters shown by default (TensorBoard shows five); declared even
            where this run has no value for them.
    """

    def __init__(self, metrics: Sequence[str], hparams: Mapping[str, Any] | None = None,
                 *, columns: Sequence[str] = ()) -> None:
        for name, value in (("metrics", metrics), ("columns", columns)):
            if isinstance(value, str):
                raise ValueError(f"{name} must be a list of names, got the string {value!r}; "
                                 f"write {name}=[{value!r}].")
        if not metrics:
            raise ValueError(f"metrics must be a non-empty list of metric names, got "
                             f"{metrics!r}; e.g. metrics=['val/acc'].")
        self.metrics = tuple(metrics)
        self.hparams = dict(hparams or {})
        self.columns = tuple(columns)
        self._declared: set[str] = set()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._declare(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._declare(trainer, pl_module)

    def _declare(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the HParams summaries once per run directory, from global rank 0 (the only
        rank whose logger has a writer; on the others Lightning hands out a stand-in)."""
        warn_without_tensorboard(trainer, "HParamsLogger", "hyperparameters and metrics")
        writer = tensorboard(trainer)
        if not trainer.is_global_zero or writer is None or writer.log_dir in self._declared:
            return
        weights = {f"{PENALTY_WEIGHT}/{name}": weight
                   for name, weight in penalty_weights(pl_module).items()}
        params = tensorboard_values({**pl_module.hparams, **weights, **self.hparams})
        experiment, start, end = hparams_summaries(params, dict.fromkeys(self.metrics, 0.0))
        file_writer = event_file_writer(writer)
        for summary in (self._with_columns(experiment), start, end):
            file_writer.add_summary(summary)
        file_writer.flush()
        self._declared.add(writer.log_dir)

    def _with_columns(self, experiment: Any) -> Any:
        """The experiment summary with every name of ``columns`` declared and marked."""
        (value,) = experiment.value
        data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
        declared = {info.name for info in data.experiment.hparam_infos}
        for name in self.columns:
            if name not in declared:
                data.experiment.hparam_infos.add(name=name)
        for info in data.experiment.hparam_infos:
            info.differs = info.name in self.columns
        value.metadata.plugin_data.content = data.SerializeToString()
        return experiment
