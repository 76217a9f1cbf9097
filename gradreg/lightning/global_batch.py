r"""DDP over global batches (``data.global_batch``): W ranks take exactly the steps of one process.

:class:`~gradreg.lightning.data.splits.RankSlices` cuts every batch of :math:`N` samples into W
contiguous slices of :math:`n_r` samples. DDP averages the ranks' gradients with equal weights, so
:class:`GlobalBatchDDPStrategy` scales each rank's loss (task and penalties, whatever the module
backpropagates, automatic or manual optimization) by the slice's weight
:math:`w_r = n_r W / N` before its backward:

.. math::

    \frac1W \sum_r w_r \nabla L_r = \frac1N \sum_r n_r \nabla L_r = \nabla L,
    \qquad L_r = \frac1{n_r} \sum_{i \in r} \ell_i,

the gradient of the mean over the whole batch, uneven slices included; so does FSDP2's
:class:`~gradreg.lightning.sharded.ShardedPenaltyStrategy` with ``global_batch=True``
(``trainer=fsdp_cpu``), whose reduce-scatter averages the ranks as DDP does. That holds for every
loss that is a mean of per-sample terms, as gradreg's penalties are (each sample's input
gradient depends on that sample only). A penalty of the *parameter* gradient
(``points="parameters"``, e.g. ``param_grad_norm``, ``sam``) is not a mean of per-sample terms:
the ``Classifier`` takes it of the whole batch's gradient over the ranks
(:class:`~gradreg.penalties.accumulation.Accumulation` with ``over_ranks``), its slices
weighted by their samples (:func:`slice_rows`: :math:`\bar g = \sum_r n_r \bar g_r / N`, one
all-reduce), and each rank's second pass, scaled by :math:`w_r` as the task is, gives
:math:`\frac1W \sum_r w_r H_r v = \frac1N \sum_r n_r H_r v`. Refused in one line: with
``accumulate_grad_batches`` > 1 (Lightning weights micro-batches equally, an uneven last window
would weigh them by samples: :func:`check_splittable`), and on a rank whose slice of the
last batch is empty (a sample of weight 0 has no place in the batch's gradient). The weight is
a Python float known on the host: no synchronization is added to the step.
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

__all__ = ["GlobalBatchDDPStrategy", "GlobalBatches", "check_splittable", "slice_rows"]


def check_splittable(penalties: Mapping[str, GradientPenalty], world: int,
                     accumulate: int = 1) -> None:
    """Raise ``ValueError`` for a penalty whose value on global batches split over ``world`` > 1
    ranks is not the one-process value: a penalty of the parameter gradient under
    ``accumulate`` > 1 micro-batches per step (module docstring)."""
    if world < 2 or accumulate < 2:
        return
    for name, penalty in penalties.items():
        if penalty.config.points == "parameters":
            raise ValueError(
                f"penalty {name!r} (points='parameters') on global batches split over {world} "
                f"ranks with accumulate_grad_batches={accumulate}: the accumulated window's "
                "gradient would weigh an uneven last micro-batch otherwise than the task; use "
                "accumulate_grad_batches=1 (a larger data.batch_size), or one process")


def slice_rows(trainer: pl.Trainer | None, rows: int) -> int | None:
    """The samples of this rank's slice of the global batch, ``rows`` long (None where the
    strategy does not weight global batches); a ``ValueError`` for a slice of weight 0 (an
    empty slice, given one sample that counts for nothing), which a parameter penalty of the
    whole batch cannot place."""
    strategy = getattr(trainer, "strategy", None)
    if not getattr(strategy, "weights_global_batches", False):
        return None
    if strategy._slice_weight == 0:
        raise ValueError(
            f"rank {trainer.global_rank}'s slice of this global batch is empty, and a penalty "
            "of the parameter gradient weights the ranks' slices by their samples: choose "
            "data.batch_size so that the last batch has a sample for every rank")
    return rows


class GlobalBatches:
    """What a data-parallel strategy adds to weight the ranks' slices of global batches (module
    docstring): the loss of each training step scaled by its slice's weight before the
    strategy's backward, where ``weights_global_batches``; :class:`GlobalBatchDDPStrategy` and,
    with ``global_batch=True``, :class:`~gradreg.lightning.sharded.ShardedPenaltyStrategy`
    (FSDP2) have it before Lightning's strategy in their bases."""

    #: what :class:`~gradreg.lightning.data.splits.SplitDataModule` asks of a strategy for global
    #: batches
    weights_global_batches = True
    #: the weight of the slice of the current training step (1 outside training steps)
    _slice_weight = 1.0

    def setup(self, trainer: pl.Trainer) -> None:
        if self.weights_global_batches:
            check_splittable(getattr(self.lightning_module, "penalties", {}), self.world_size,
                             trainer.accumulate_grad_batches)
        super().setup(trainer)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.weights_global_batches:
            slices = self.lightning_module.trainer.train_dataloader.batch_sampler
            if not isinstance(slices, RankSlices):
                raise ValueError(
                    f"{type(self).__name__} weights the ranks' slices of global batches: build "
                    "the data module with global_batch=True and the Trainer with "
                    "use_distributed_sampler=False")
            self._slice_weight = slices.weights.popleft()
        return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any,
                 **kwargs: Any) -> Tensor:
        return super().backward(closure_loss * self._slice_weight, optimizer, *args, **kwargs)


class GlobalBatchDDPStrategy(GlobalBatches, DDPStrategy):
    """Lightning's ``DDPStrategy`` (same arguments: ``find_unused_parameters=True``,
    ``start_method="spawn"`` ...) whose backward scales the loss by the weight of the rank's
    slice of the global batch (module docstring). Use it with a data module built with
    ``global_batch=True`` and ``Trainer(use_distributed_sampler=False)``; a training loader
    without :class:`~gradreg.lightning.data.splits.RankSlices` raises ``ValueError`` at its
    first step."""
