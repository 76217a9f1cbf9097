"""FSDP2 in a Lightning Trainer, gradient penalties exact: :class:`ShardedPenaltyStrategy`.

Lightning's ``ModelParallelStrategy`` runs FSDP2 (``fully_shard``) applied in the module's
``configure_model`` hook. This strategy supplies that hook for modules that have none: it
shards the submodules it is told (the GAN's ``critic`` and ``generator``, the classifier's
``backbone``) layer by layer and at their root, over all ranks (a 1-D mesh). Every network
that trains must be sharded: FSDP2 is also what averages the ranks' gradients, and a network
left out would train on its rank's data alone. It then holds them as
:func:`gradreg.sharding.penalty_step` does (:class:`~gradreg.sharding.HeldStep`) for the whole
fit, and after every backward, before the optimizer step, runs FSDP's gradient reduction once:
so every penalty's parameter gradient is that of the unsharded module, with the memory
stated in :mod:`gradreg.sharding` (the parameters gathered during the step; the optimizer state
and, between steps, the parameters sharded). Tested on the CPU with gloo (2 processes, torch
2.13 and 2.14); not yet run on a GPU. Under a Hydra multirun it is refused like ``ddp``: its extra
ranks re-run the command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

from gradreg import GradientError, sharding
from gradreg.lightning.compat import data_parallel_over_all_ranks
from gradreg.lightning.global_batch import GlobalBatches
from gradreg.sharding import HeldStep, is_sharded

__all__ = ["ShardedPenaltyStrategy"]


def _shard(module: nn.Module, mesh: Any) -> None:
    """``fully_shard`` on every submodule that holds parameters of its own, then on ``module``."""
    from torch.distributed.fsdp import fully_shard

    for sub in list(module.modules())[1:]:
        if any(True for _ in sub.parameters(recurse=False)):
            fully_shard(sub, mesh=mesh)
    fully_shard(module, mesh=mesh)


class ShardedPenaltyStrategy(GlobalBatches, ModelParallelStrategy):
    """``ModelParallelStrategy`` with FSDP2 on the submodules named ``modules`` (those the
    LightningModule has), every rank one shard (data parallel over all ranks, no tensor
    parallelism), penalties exact (module docstring). ``global_batch``: the ranks' slices of
    global batches weighted by their samples (:class:`~gradreg.lightning.global_batch
    .GlobalBatches`, ``data.global_batch``), as ``GlobalBatchDDPStrategy`` does under DDP."""

    def __init__(self, modules: Sequence[str] = ("critic", "generator", "backbone"),
                 global_batch: bool = False, **kwargs: Any) -> None:
        super().__init__(tensor_parallel_size=1, **kwargs)
        self.sharded_names = tuple(modules)
        self.weights_global_batches = global_batch
        self._held: list[HeldStep] = []

    def connect(self, model: L.LightningModule) -> None:
        """Refuse a torch without public FSDP2 (when fitting starts: the trainer itself builds on
        any torch), then supply ``configure_model`` where the module has none."""
        if not sharding.supports_exact_step():
            raise GradientError(
                f"ShardedPenaltyStrategy needs torch >= "
                f"{'.'.join(map(str, sharding.FSDP_MIN_TORCH))} (public FSDP2); torch "
                f"{torch.__version__} has not: use DDP (trainer=ddp_cpu) or upgrade torch."
            )
        super().connect(model)
        if not is_overridden("configure_model", model):
            model.configure_model = partial(self._configure_model, model)

    def setup_environment(self) -> None:
        data_parallel_over_all_ranks(self)
        super().setup_environment()

    def _configure_model(self, model: L.LightningModule) -> None:
        named = [getattr(model, name) for name in self.sharded_names
                 if isinstance(getattr(model, name, None), nn.Module)]
        if not named:
            raise ValueError(
                f"ShardedPenaltyStrategy shards the submodules {list(self.sharded_names)}, and "
                f"{type(model).__name__} has none of them: name its submodules to shard "
                "(strategy.modules=[...])"
            )
        for module in named:
            if not is_sharded(module):
                _shard(module, self.device_mesh["data_parallel"])

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        model = self.lightning_module
        self._held = [HeldStep(getattr(model, name)) for name in self.sharded_names
                      if is_sharded(getattr(model, name, nn.Module()))]

    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        for held in self._held:
            held.reduce()

    def teardown(self) -> None:
        for held in self._held:
            held.release()
        self._held = []
        super().teardown()
