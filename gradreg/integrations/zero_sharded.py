r"""A parameter penalty's finite difference on DeepSpeed ZeRO-3's partitions:
:class:`ShardedStep`, each rank's extra memory one buffer of its own partition, not of the
whole parameters.

The arithmetic is :class:`gradreg.penalties.shards.ShardedStep`'s (the one FSDP2's
:class:`gradreg.sharding.ShardedPenalty` runs too): one all-reduce of the ranks' sums of
squares gives :math:`\lVert \bar g \rVert^2`, the penalty's value and direction
:math:`v = 2\,P'\,\bar g`, each rank shifts its partitions by :math:`h\,v^{(r)}/\lVert v
\rVert`, a second pass of the step's micro-batches through the engine gives :math:`\bar
g'^{(r)}`, and :math:`\bar g^{(r)} + c\,\lVert v \rVert / h\,(\bar g'^{(r)} - \bar
g^{(r)})` is written into the engine's partitions before ``engine.step()``. This module is
ZeRO-3's side of it (:class:`ZeroShards`): ZeRO-3's backward leaves on each rank the partition
of the step's gradient, reduce-scattered and averaged over the ranks and the micro-batches of
``gradient_accumulation_steps``, read and written through ``deepspeed.utils``'s
``safe_get_local_grad``/``safe_set_local_grad``; the parameters' partitions (``ds_tensor``)
are shifted and put back bitwise by :func:`shifted_partitions`.

Each rank holds one partition-sized copy: of the penalized parameters' partitions (put back
from it) and of the other parameters' gradients, the step's gradient computed in ZeRO-3's own
buffers; plus the parameters ZeRO-3 keeps gathered (``ds_persist``: below its persistence
threshold), whose :math:`\bar g` is gathered whole to shift them: memory
:math:`O(\text{parameters}/W)`. Taken: the 2-norm (``p=2``), float32 (fp16
and bf16 not yet tested), the optimizer's states on the device (no ``offload_optimizer``);
:class:`~gradreg.integrations.engine_penalty.EnginePenalty` takes the others with the
parameters gathered whole.

Imports DeepSpeed (``deepspeed.utils``) when a step finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor

from gradreg.autograd import GradientError
from gradreg.penalties import GradientPenalty, shards

__all__ = ["ShardedStep", "ZeroShards", "partition_range", "shifted_partitions",
           "takes_sharded"]


def takes_sharded(engine: Any, penalty: GradientPenalty) -> bool:
    """Whether :class:`ShardedStep` takes ``penalty`` on ``engine`` (ZeRO-3): a finite
    difference of the 2-norm along the gradient
    (:func:`~gradreg.penalties.shards.takes_shards`), float32 (neither fp16 nor bf16 enabled:
    not yet tested), the optimizer's states not offloaded."""
    return (shards.takes_shards(penalty) and not engine.fp16_enabled()
            and not engine.bfloat16_enabled() and not engine.zero_use_cpu_optimizer())


def partition_range(param: Tensor) -> tuple[int, int]:
    """(start, count): the entries of the flattened parameter that this rank's ZeRO-3
    partition (``ds_tensor``, padded to equal sizes) holds, its first ``count`` entries."""
    size = int(param.ds_tensor.ds_numel)
    start = size * torch.distributed.get_rank(group=param.ds_process_group)
    return start, max(0, min(size, int(param.ds_numel) - start))


@contextmanager
def shifted_partitions(params: Sequence[Tensor], amounts: Sequence[Tensor],
                       partition: Callable[[int, int, int], Tensor],
                       whole: Callable[[list[int]], list[Tensor]]) -> Iterator[None]:
    r"""The block runs at :math:`\theta_j + a_j d_j` on DeepSpeed ZeRO-3's partitioned
    parameters: each rank shifts its partition (``ds_tensor``) by ``partition(j, start,
    count)``, the entries ``start:start + count`` of :math:`d_j` flattened
    (:func:`partition_range`), and where a parameter is held gathered (a persistent one) its
    data by ``whole(indices)``, :math:`d_j` flattened whole for each of those (called on every
    rank alike: it may gather). ZeRO-3's own gathers in the block's forwards and backwards then
    compute with the shifted parameters. Put back bitwise after it: the partitions copied back;
    a parameter held gathered on entry gets its values back in whatever data it holds on exit (a
    gather in the block may have given it new data, with the shifted values, which the step's
    backward would read); one gathered in the block is released (``partition()``: gathered
    again from the restored partitions)."""
    for param in params:  # a persistent parameter stays as a gather leaves it: gathered first
        if param.ds_persist and param.data.numel() == 0:
            param.all_gather()
    targets, shifts, scales = [], [], []
    for j, (param, amount) in enumerate(zip(params, amounts, strict=True)):
        part = param.ds_tensor
        start, count = partition_range(param)
        shared = param.data.untyped_storage().data_ptr() == part.untyped_storage().data_ptr()
        if count and not shared:  # one process: the partition may be the data itself
            targets.append(part.narrow(0, 0, count))
            shifts.append(partition(j, start, count))
            scales.append(amount)
    held = [j for j, param in enumerate(params) if param.data.numel() == param.ds_numel]
    for j, vector in zip(held, whole(held), strict=True):  # persistent, or not yet freed
        targets.append(params[j].data.view(-1))
        shifts.append(vector)
        scales.append(amounts[j])
    saved = [t.clone() for t in targets]
    saved_whole = {j: params[j].data.clone() for j in held}
    try:
        torch._foreach_addcmul_(targets, shifts, scales)
        yield
    finally:
        torch._foreach_copy_(targets, saved)
        for j, param in enumerate(params):
            values = saved_whole.get(j)
            if values is not None and param.data.numel() == values.numel():
                param.data.copy_(values.view_as(param.data))  # a gather may have given new data
            elif values is None and param.data.numel() > 0 and not param.ds_persist:
                param.partition()


class ZeroShards:
    """DeepSpeed ZeRO-3's ``engine`` as :class:`~gradreg.penalties.shards.ShardedStep` reads
    and writes it (:class:`~gradreg.penalties.shards.Shards`): the gradients' partitions
    through ``deepspeed.utils.safe_get_local_grad``/``safe_set_local_grad``, the parameters'
    partitions (``ds_tensor``) and the persistent ones shifted by :func:`shifted_partitions`,
    the engine's own backward. ``params``: the penalized parameters, then the engine's other
    trainable ones."""

    name = "EnginePenalty under ZeRO-3"

    def __init__(self, engine: Any, params: Sequence[Tensor], count: int) -> None:
        self.engine, self.target, self.params, self.count = engine, engine, list(params), count
        self.group = params[0].ds_process_group
        self.counts = [partition_range(p)[1] for p in self.params]

    def entries(self) -> int:
        return sum(int(p.ds_numel) for p in self.params[:self.count])

    def gradients(self) -> list[Tensor]:
        from deepspeed.utils import safe_get_local_grad

        return [safe_get_local_grad(p).narrow(0, 0, n)
                for p, n in zip(self.params, self.counts, strict=True)]

    def set_gradients(self, values: Sequence[Tensor]) -> None:
        from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

        for p, n, g in zip(self.params, self.counts, values, strict=True):
            local = safe_get_local_grad(p)
            local.narrow(0, 0, n).copy_(g)
            safe_set_local_grad(p, local)

    def scale_gradients(self, factor: Tensor) -> None:
        from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

        for p, n in zip(self.params[:self.count], self.counts[:self.count], strict=True):
            local = safe_get_local_grad(p)
            local.narrow(0, 0, n).mul_(factor.to(local.dtype))
            safe_set_local_grad(p, local)

    def shifted(self, directions: Sequence[Tensor], amount: Tensor) -> AbstractContextManager:
        from deepspeed.utils import safe_get_local_grad

        params = self.params[:self.count]

        def whole(held: list[int]) -> list[Tensor]:  # ḡ of the parameters held gathered
            return [_gathered(safe_get_local_grad(params[j]), params[j], self.group)
                    for j in held]

        return shifted_partitions(params, [amount.to(d.dtype) for d in directions],
                                  lambda j, _start, _count: directions[j], whole)

    def backward(self, loss: Tensor) -> None:
        self.engine.backward(loss)

    def buffers(self) -> list[Tensor]:
        return list(self.engine.module.buffers())


class ShardedStep(shards.ShardedStep):
    """The penalty ``penalty`` (:func:`takes_sharded`) of the step's gradient w.r.t. ``params``
    on ZeRO-3's ``engine``, on each rank's partitions (module docstring): :meth:`add` keeps
    each micro-batch after the engine's backward of its loss, :meth:`finish` (after the step's
    last micro-batch's backward, before ``engine.step()``) runs the second pass and leaves the
    step's gradient in the engine's partitions. The engine's other trainable parameters take
    the task's gradient alone."""

    def __init__(self, engine: Any, penalty: GradientPenalty, params: Sequence[Tensor]) -> None:
        foreign = [j for j, p in enumerate(params) if not hasattr(p, "ds_id")]
        if foreign:
            raise GradientError(
                f"EnginePenalty under ZeRO-3: parameters {foreign[:5]} of the {len(params)} "
                "given are not partitioned by the engine (no ds_id): pass parameters of "
                "engine.module.")
        self.engine, self.params = engine, list(params)
        chosen = set(map(id, self.params))
        self.others = [p for p in engine.module.parameters()
                       if p.requires_grad and id(p) not in chosen]
        super().__init__(ZeroShards(engine, self.params + self.others, len(self.params)),
                         penalty, len(self.params))


def _gathered(local: Tensor, param: Tensor, group: Any) -> Tensor:
    """The whole flattened tensor of which ``local`` is this rank's ZeRO-3 partition (padded
    to equal sizes), by one all-gather over ``group``."""
    parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts).narrow(0, 0, int(param.ds_numel))
