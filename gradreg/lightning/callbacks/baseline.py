r"""The penalty a run without one would have had: a baseline for the penalty charts.

A sweep such as ``penalty=none,double_backprop`` asks what the penalty did; its charts need the
penalty-free run's value of the same quantity. On the logging steps, before the step (the
parameters the step sees, the module in the mode it trains in), this callback evaluates the
preset's unweighted penalty :math:`P` on the training batch, for a module that has no penalty
of its own, and logs it under the tag the penalized runs use, ``penalty/unweighted/penalties.
<preset>``, with the weight ``penalty/weight/penalties.<preset>`` = 0. It is a measurement, not a
term of the loss: the input gradient is taken with ``create_graph=False`` and the value
detached, so no parameter gradient comes of it (and no double backward is paid). A module with
penalties of its own logs their real values, and the callback does nothing.

Supported: penalties of the gradient norm at a classifier's inputs with a fixed target
(``points="inputs"``, ``kind="gradient_norm"``, derivative order 1, projection ``"sum"``: double
backprop and its variants of target, power, norm and reduction) on ``(inputs, targets)``
batches; the module's ``forward`` gives the logits, the per-sample loss is cross-entropy.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from gradreg import gradient
from gradreg.lightning.callbacks._logging import check_every, log_scalars, logging_due
from gradreg.lightning.callbacks._penalties import named_penalties
from gradreg.lightning.callbacks._probe import split_batch
from gradreg.lightning.dashboards.tags import PENALTY_UNWEIGHTED, PENALTY_WEIGHT
from gradreg.penalties import GradientPenalty, as_points, make_penalty, per_sample_norm
from gradreg.penalties.formulas.norms import penalty_from_norms


class PenaltyBaseline(pl.Callback):
    """Log the unweighted ``penalty`` of a module trained without penalties (module docstring).

    Args:
        penalty: a preset name (``"double_backprop"``) or a :class:`GradientPenalty` (its weight
            is not used).
        name: the penalty's name in the tags (``penalties.<name>``, as the app names a
            ``penalty=<preset>`` run's); default the preset's name.
        every_n_steps: the interval in optimizer steps; ``None`` follows the Trainer's
            ``log_every_n_steps``.
    """

    charts = ("penalty_unweighted",)

    def __init__(self, penalty: str | GradientPenalty = "double_backprop", *,
                 name: str | None = None, every_n_steps: int | None = None) -> None:
        check_every(every_n_steps)
        if isinstance(penalty, str):
            name = name or penalty
            penalty = make_penalty(penalty)
        elif name is None:
            raise ValueError("name the penalty of the baseline: PenaltyBaseline(penalty, "
                             "name='double_backprop').")
        if not (penalty.config.points == "inputs" and penalty.config.kind.name == "gradient_norm"
                and penalty.config.projection == "sum" and penalty.config.order == 1
                and not isinstance(penalty.config.target, str)):
            raise ValueError(
                f"PenaltyBaseline evaluates gradient-norm penalties at a classifier's inputs "
                f"with a fixed target (points='inputs', kind='gradient_norm', order 1, "
                f"projection 'sum', e.g. double_backprop); {name!r} has points="
                f"{penalty.config.points!r}, kind={penalty.config.kind.name!r}, projection="
                f"{penalty.config.projection!r}, target={penalty.config.target!r}.")
        self.penalty, self.name = penalty, name
        self.every_n_steps = every_n_steps

    def penalty_paths(self, pl_module: pl.LightningModule) -> tuple[str, ...]:
        """The module path its values are logged under for ``pl_module`` (none where the
        module has penalties of its own), for the layout's penalty charts."""
        return () if named_penalties(pl_module) else (f"penalties.{self.name}",)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if not self.penalty_paths(pl_module) or not logging_due(trainer, self.every_n_steps):
            return
        inputs, targets = split_batch(batch, "PenaltyBaseline")
        path = f"penalties.{self.name}"
        log_scalars(trainer, {f"{PENALTY_UNWEIGHTED}/{path}": self.value(pl_module, inputs,
                                                                          targets),
                              f"{PENALTY_WEIGHT}/{path}": 0.0})

    def value(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
              ) -> torch.Tensor:
        """The unweighted penalty of ``model`` on the batch, detached (no parameter gradient)."""
        gp = self.penalty
        with torch.enable_grad():
            x = as_points(inputs.detach().clone())
            logits = model(x)
            outputs = (F.cross_entropy(logits, targets, reduction="none") if gp.config.of == "loss"
                       else logits)
            grads = gradient(outputs.sum(), x, create_graph=False)
        norms = per_sample_norm(grads, gp.config.p, squared=gp.config.squared)
        return penalty_from_norms(norms, target=gp.config.target, one_sided=gp.config.one_sided,
                                  power=gp.config.power, reduction=gp.config.reduction,
                                  squared=gp.config.squared).detach()
