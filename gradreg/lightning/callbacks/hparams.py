"""Log a run's hyperparameters with its final metrics, for TensorBoard's HParams tab.

A sweep (say, penalty weight against clean and FGSM accuracy) is then compared run by run in one
table. The hyperparameters are the module's ``hparams`` (``save_hyperparameters``), the weight of
every :class:`~gradreg.penalties.GradientPenalty` submodule as ``penalty_weight/<module path>``,
and any ``hparams`` given here; the metrics are the trainer's ``callback_metrics`` at the end of
fit and of test, logged as ``hp/<metric>`` (their own tags, one value each, so the time series of
the same metric stays untouched).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from gradreg.lightning.callbacks._logging import warn_without_tensorboard
from gradreg.lightning.callbacks._penalties import named_penalties
from gradreg.lightning.dashboards import HPARAM_METRIC, PENALTY_WEIGHT


class HParamsLogger(pl.Callback):
    """At fit end and test end, ``TensorBoardLogger.log_hyperparams(hparams, final metrics)``.

    Args:
        metrics: names in ``trainer.callback_metrics`` to report (e.g. ``["val/acc",
            "test/acc_fgsm"]``); ``None`` reports every scalar metric.
        hparams: extra hyperparameters (e.g. a flattened experiment config).

    Build the logger with ``TensorBoardLogger(..., default_hp_metric=False)`` so that Lightning
    does not add its placeholder ``hp_metric`` column.
    """

    def __init__(
        self, metrics: Sequence[str] | None = None, hparams: Mapping[str, Any] | None = None
    ) -> None:
        if isinstance(metrics, str):
            raise ValueError(f"metrics must be a list of names, got the string {metrics!r}; "
                             f"write metrics=[{metrics!r}].")
        self.metrics = None if metrics is None else tuple(metrics)
        self.hparams = dict(hparams or {})
        self.final: dict[str, float] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "HParamsLogger", "hyperparameters with final metrics")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.final.update({
            name: float(value)
            for name, value in trainer.callback_metrics.items()
            if (self.metrics is None or name in self.metrics)
            and (not isinstance(value, Tensor) or value.numel() == 1)
        })
        weights = {
            f"{PENALTY_WEIGHT}/{name}": penalty.weight
            for name, penalty in named_penalties(pl_module).items()
        }
        params = {**pl_module.hparams, **weights, **self.hparams}
        metrics = {f"{HPARAM_METRIC}/{name}": value for name, value in self.final.items()}
        if not metrics:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.log_hyperparams(params, metrics, step=trainer.global_step)
