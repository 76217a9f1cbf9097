"""The logger of the dashboards' steps: Lightning's TensorBoard logger without the ``epoch``
scalar that Lightning adds to the metrics of every logged step."""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger


class TensorBoardLogger(LightningTensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` without the ``epoch`` scalar that Lightning adds to the
    metrics of every logged step (the chart TensorBoard's Time Series tab would open on, which
    says nothing the step axis does not)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics({tag: value for tag, value in metrics.items() if tag != "epoch"},
                            step)
