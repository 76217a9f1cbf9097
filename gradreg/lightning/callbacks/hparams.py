"""Log a run's hyperparameters with its final metrics, for TensorBoard's HParams tab.

A sweep (say, penalty weight against clean and FGSM accuracy) is then compared run by run in one
table. TensorBoard's HParams plugin reads, per run, one summary declaring the hyperparameter
values and the metric tags (the first one written; later ones are ignored), and takes each
metric's value from the latest scalar under its tag. So the callback declares at the start of
fit (or test) and logs the values when fit and test end:

* hyperparameters: the module's ``hparams`` (``save_hyperparameters``), the weight of every
  :class:`~gradreg.penalties.GradientPenalty` submodule at the start as
  ``penalty_weight/<module path>``, and the ``hparams`` given here (e.g. a flattened config);
* metrics: each name in ``metrics`` found in ``trainer.callback_metrics`` at fit end and test
  end, as the scalar ``hp/<name>`` (its own tag, so the metric's own time series is untouched).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from torch.utils.tensorboard.summary import hparams as hparams_summaries

from gradreg.lightning.callbacks._logging import (
    log_scalars,
    tensorboard,
    warn_without_tensorboard,
)
from gradreg.lightning.callbacks._penalties import named_penalties
from gradreg.lightning.dashboards import HPARAM_METRIC, PENALTY_WEIGHT

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
    """Declare hyperparameters and metric tags at the start, log final metric values at the end.

    Args:
        metrics: names in ``trainer.callback_metrics`` to compare runs by (e.g.
            ``["val/acc", "test/acc_fgsm"]``); they become the HParams tab's columns.
        hparams: extra hyperparameters (e.g. a flattened experiment config).
    """

    def __init__(self, metrics: Sequence[str], hparams: Mapping[str, Any] | None = None) -> None:
        if isinstance(metrics, str) or not metrics:
            raise ValueError(
                f"metrics must be a non-empty list of metric names, got {metrics!r}; "
                "e.g. metrics=['val/acc']."
            )
        self.metrics = tuple(metrics)
        self.hparams = dict(hparams or {})
        self._declared: set[str] = set()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._declare(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._declare(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_metrics(trainer)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_metrics(trainer)

    def _declare(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the HParams summaries once per run directory."""
        warn_without_tensorboard(trainer, "HParamsLogger", "hyperparameters and metrics")
        writer = tensorboard(trainer)
        if writer is None or writer.log_dir in self._declared:
            return
        weights = {
            f"{PENALTY_WEIGHT}/{name}": penalty.weight
            for name, penalty in named_penalties(pl_module).items()
        }
        params = tensorboard_values({**pl_module.hparams, **weights, **self.hparams})
        tags = dict.fromkeys((f"{HPARAM_METRIC}/{name}" for name in self.metrics), 0.0)
        for summary in hparams_summaries(params, tags):
            writer._get_file_writer().add_summary(summary)
        self._declared.add(writer.log_dir)

    def _log_metrics(self, trainer: pl.Trainer) -> None:
        found = {name: trainer.callback_metrics[name] for name in self.metrics
                 if name in trainer.callback_metrics}
        log_scalars(trainer, {f"{HPARAM_METRIC}/{name}": value for name, value in found.items()})
