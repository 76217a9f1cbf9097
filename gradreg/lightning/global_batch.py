r"""DDP over global batches (``data.global_batch``): W ranks take exactly the steps of one process.

:class:`~gradreg.lightning.data.splits.RankSlices` cuts every batch of :math:`N` samples into W
contiguous slices of :math:`n_r` samples. DDP averages the ranks' gradients with equal weights, so
:class:`GlobalBatchDDPStrategy` scales each rank's loss (task and penalties, whatever the module
backpropagates, automatic or manual optimization) by the slice's weight
:math:`w_r = n_r W / N` before its backward:

.. math::

    \frac1W \sum_r w_r \nabla L_r = \frac1N \sum_r n_r \nabla L_r = \nabla L,
    \qquad L_r = \frac1{n_r} \sum_{i \in r} \ell_i,

the gradient of the mean over the whole batch, uneven slices included. That holds for every
loss that is a mean of per-sample terms, as gradreg's penalties are (each sample's input
gradient depends on that sample only). A penalty of the *parameter* gradient
(``points="parameters"``, e.g. ``param_grad_norm``) is not: each rank would penalize the norm of
its own slice's gradient, not of the batch's (measured 2.1e-3 apart from one process after 3
steps), so :func:`check_splittable` refuses it. The weight is a Python float known on the host:
no synchronization is added to the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.optim import Optimizer

from gradreg.lightning.data.splits import RankSlices
from gradreg.penalties import GradientPenalty

__all__ = ["GlobalBatchDDPStrategy", "check_splittable"]


def check_splittable(penalties: Mapping[str, GradientPenalty], world: int) -> None:
    """Raise ``ValueError`` for a penalty whose value on a global batch split over ``world`` > 1
    ranks is not the one-process value (a penalty of the parameter gradient)."""
    if world < 2:
        return
    for name, penalty in penalties.items():
        if penalty.config.points == "parameters":
            raise ValueError(
                f"penalty {name!r} (points='parameters') penalizes the norm of the batch's "
                f"parameter gradient, which no rank of {world} holds under global_batch=True "
                "(each would penalize its own slice's gradient, a different value): train it in "
                "one process, or without global_batch (batch_size per rank, a different run)")


class GlobalBatchDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` (same arguments: ``find_unused_parameters=True``,
    ``start_method="spawn"`` ...) whose backward scales the loss by the weight of the rank's
    slice of the global batch (module docstring). Use it with a data module built with
    ``global_batch=True`` and ``Trainer(use_distributed_sampler=False)``; a training loader
    without :class:`~gradreg.lightning.data.splits.RankSlices` raises ``ValueError`` at its
    first step."""

    #: what :class:`~gradreg.lightning.data.splits.SplitDataModule` asks of a strategy for global
    #: batches
    weights_global_batches = True
    #: the weight of the slice of the current training step (1 outside training steps)
    _slice_weight = 1.0

    def setup(self, trainer: pl.Trainer) -> None:
        check_splittable(getattr(self.lightning_module, "penalties", {}), self.world_size)
        super().setup(trainer)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        slices = self.lightning_module.trainer.train_dataloader.batch_sampler
        if not isinstance(slices, RankSlices):
            raise ValueError(
                f"{type(self).__name__} weights the ranks' slices of global batches: build the "
                "data module with global_batch=True and the Trainer with "
                "use_distributed_sampler=False")
        self._slice_weight = slices.weights.popleft()
        return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any,
                 **kwargs: Any) -> Tensor:
        return super().backward(closure_loss * self._slice_weight, optimizer, *args, **kwargs)
