"""Write the custom-scalars layout once, so TensorBoard shows outcome, loss, penalties and norms
together."""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl

from gradreg.lightning.callbacks._logging import tensorboard, warn_without_tensorboard
from gradreg.lightning.callbacks._penalties import named_penalties
from gradreg.lightning.dashboards.charts import CHARTS, OUTCOMES, TASK_LOSS, custom_scalars_layout

#: the charts of the penalties' own values, left out for a module without penalties
PENALTY_CHARTS = ("penalty_weighted", "penalty_unweighted", "penalty_weight", "grad_split")


class CustomScalarsLayout(pl.Callback):
    """At fit start, ``add_custom_scalars`` of :func:`.dashboards.custom_scalars_layout`: the
    ``outcome`` charts, the task loss chart and the charts the trainer's other callbacks feed
    (their ``charts`` attribute: :class:`GradientNormMonitor` the losses, penalties and norms,
    :class:`InterpolatesGradientNorm` the critic's gradient norm, :class:`GradientSplit` the
    penalty's and the task's parts of the parameter gradient, one chart per layer that it
    names with ``split_layers``), each unweighted penalty on a chart of its own (also a
    :class:`PenaltyBaseline`'s, for a module without penalties). The penalties' charts
    are left out for a module without penalties (but for a baseline's unweighted value and
    weight), so that no chart stays empty.

    Args:
        loss: regexes of the module's training task-loss tags (matched from the tag's start); the
            default matches gradreg's classifier and GAN, so that runs of both in one log folder
            share one layout.
        outcome: the outcome charts of the module's validation metrics, first in the layout,
            one chart per metric (:data:`~gradreg.lightning.dashboards.OUTCOMES`): a
            classifier's ``"accuracy"``, ``"accuracy_fgsm"``, ``"accuracy_pgd"`` (``val/acc``,
            ``val/acc_fgsm``, ``val/acc_pgd``), a GAN's ``"energy_distance"``,
            ``"feature_energy_distance"`` and ``"modes"``.
    """

    def __init__(self, loss: Sequence[str] = TASK_LOSS, outcome: Sequence[str] = ()) -> None:
        for name, value in (("loss", loss), ("outcome", outcome)):
            if isinstance(value, str):
                raise ValueError(f"{name} must be a list, got the string {value!r}; "
                                 f"write {name}=[{value!r}].")
        unknown = sorted(set(outcome) - set(OUTCOMES))
        if unknown:
            raise ValueError(f"unknown outcome charts {unknown}; the outcome charts are "
                             f"{list(OUTCOMES)}")
        self.loss = tuple(loss)
        self.outcome = tuple(outcome)
        self.layout: dict[str, dict[str, list]] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "CustomScalarsLayout", "the layout")
        fed = {chart for callback in trainer.callbacks
               for chart in getattr(callback, "charts", ()) if chart in CHARTS}
        penalties = sorted({*named_penalties(pl_module),
                            *(path for callback in trainer.callbacks
                              if hasattr(callback, "penalty_paths")
                              for path in callback.penalty_paths(pl_module))})
        if not penalties:
            fed -= set(PENALTY_CHARTS)
        elif not named_penalties(pl_module):  # a baseline's values only
            fed -= {"penalty_weighted", "grad_split"}
        layers = [layer for callback in trainer.callbacks if hasattr(callback, "split_layers")
                  for layer in callback.split_layers(pl_module)]
        self.layout = custom_scalars_layout(self.loss, {*self.outcome, "task_loss", *fed},
                                            penalties=penalties, layers=layers)
        writer = tensorboard(trainer)
        if writer is not None:
            writer.add_custom_scalars(self.layout)
