r"""A parameter penalty's finite difference on DeepSpeed ZeRO-3's partitions:
:class:`ShardedStep`, each rank's extra memory a few buffers of its own partition, not of the
whole parameters.

ZeRO-3 holds each parameter partitioned over the :math:`W` ranks, and its backward leaves on
each rank the partition of the step's gradient, reduce-scattered and averaged over the ranks
and the :math:`N` micro-batches of ``gradient_accumulation_steps``: rank :math:`r`'s slice
:math:`\bar g^{(r)}` of :math:`\bar g`. A penalty :math:`c\,P(\lVert \bar g \rVert_2)` (``sam``,
``gr``, ``param_grad_norm`` by finite difference) needs of :math:`\bar g` only

* its squared norm :math:`S = \sum_r \lVert \bar g^{(r)} \rVert^2`, one all-reduce of each
  rank's sum of squares; the value :math:`c\,P` and the direction :math:`v = \partial P /
  \partial \bar g = 2\,P'(S)\,\bar g` (the penalty's own formula, :math:`P'` by autograd of
  the scalar), whose partition :math:`v^{(r)}` is :math:`\bar g^{(r)}` times one number, and
  :math:`\lVert v \rVert = 2 \lvert P'(S)\rvert \sqrt S`;
* the gradient :math:`\bar g'` at :math:`\theta + h \hat v` (:math:`h` by the penalty's
  ``shift`` rule): each rank shifts its partitions of the parameters by :math:`h\,
  v^{(r)}/\lVert v \rVert` (:func:`shifted_partitions`), and a second pass of the step's
  micro-batches through the engine (each forward drawing the random numbers of its first,
  the modules' buffers kept) leaves :math:`\bar g'^{(r)}` in the engine's partitions;

and the step's gradient is, on each rank's partition,

.. math::

    \bar g^{(r)} + c\,\frac{\lVert v \rVert}{h} \bigl(\bar g'^{(r)} - \bar g^{(r)}\bigr),

the difference quotient of :class:`~gradreg.penalties.accumulation.Accumulation`, written
into the engine's partitions (``deepspeed.utils.safe_set_local_grad``) before
``engine.step()``: the optimizer, and its gradient clipping, see this gradient only. The
parameters' partitions are put back bitwise after the second pass.

Each rank holds one partition-sized copy of :math:`\bar g` (its own share) and one of the
parameters' partitions (put back from it), plus the parameters ZeRO-3 keeps gathered
(``ds_persist``: below its persistence threshold), whose :math:`\bar g` is gathered whole to
shift them: memory :math:`O(\text{parameters}/W)`. The first pass is the step's own
(``engine.backward`` of each micro-batch's loss); the second costs one more forward and
backward per micro-batch, as any finite difference. Taken: the 2-norm (``p=2``), float32 (fp16
and bf16 not yet tested), the optimizer's states on the device (no ``offload_optimizer``);
:class:`~gradreg.integrations.engine_penalty.EnginePenalty` takes the others with the
parameters gathered whole.

Imports DeepSpeed (``deepspeed.utils``) when a step finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from gradreg.autograd import GradientError
from gradreg.penalties import GeneratorState, GradientPenalty
from gradreg.penalties.accumulation import agreed_over_ranks
from gradreg.penalties.guards.precision import unit_roundoff
from gradreg.penalties.methods.param_gradient import (
    check_default_step_is_smooth,
    parameter_step,
    shift_length,
)
from gradreg.penalties.state.randomness import UnreplayedDraws

__all__ = ["ShardedStep", "partition_range", "shifted_partitions", "takes_sharded"]

LossOf = Callable[[nn.Module], Tensor]


def takes_sharded(engine: Any, penalty: GradientPenalty) -> bool:
    """Whether :class:`ShardedStep` takes ``penalty`` on ``engine`` (ZeRO-3): a finite
    difference of the 2-norm, float32 (neither fp16 nor bf16 enabled: not yet tested), the
    optimizer's states not offloaded."""
    return (penalty.needs_callable and penalty.config.p == 2 and not engine.fp16_enabled()
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


class ShardedStep:
    r"""The penalty ``penalty`` (a finite difference of the 2-norm, :func:`takes_sharded`) of
    the step's gradient w.r.t. ``params`` on ZeRO-3's ``engine``, on each rank's partitions
    (module docstring): :meth:`add` keeps each micro-batch after the engine's backward of its
    loss, :meth:`finish` (after the step's last micro-batch's backward, before
    ``engine.step()``) runs the second pass and leaves the step's gradient in the engine's
    partitions. The engine's other trainable parameters take the task's gradient alone."""

    def __init__(self, engine: Any, penalty: GradientPenalty, params: Sequence[Tensor]) -> None:
        foreign = [j for j, p in enumerate(params) if not hasattr(p, "ds_id")]
        if foreign:
            raise GradientError(
                f"EnginePenalty under ZeRO-3: parameters {foreign[:5]} of the {len(params)} "
                "given are not partitioned by the engine (no ds_id): pass parameters of "
                "engine.module.")
        self.engine, self.penalty, self.params = engine, penalty, list(params)
        chosen = set(map(id, self.params))
        self.others = [p for p in engine.module.parameters()
                       if p.requires_grad and id(p) not in chosen]
        self._kept: list[tuple[LossOf, GeneratorState]] = []
        self._roundoff = 0.0
        self._checked = False  # the first step's checks: a smooth loss, replayed draws

    def add(self, loss_of: LossOf, state: GeneratorState, loss: Tensor) -> None:
        """Keep one micro-batch: ``loss_of(engine)`` computes its loss, whose forward began
        from ``state``; ``loss`` is that of its first pass (its graph not yet freed)."""
        config = self.penalty.config
        if not (self._kept or self._checked):
            check_default_step_is_smooth(loss, config.step, config.shift, config.adaptive)
        self._kept.append((loss_of, state))
        self._roundoff = max(self._roundoff, unit_roundoff(loss))

    def finish(self) -> Tensor:
        r"""The step's gradient in the engine's partitions (module docstring); returns the
        weighted penalty :math:`c\,P(\bar g)` (detached), the same on every rank."""
        from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

        penalty, config, engine = self.penalty, self.penalty.config, self.engine
        kept, roundoff = self._kept, self._roundoff
        self._kept, self._roundoff = [], 0.0
        params, every = self.params, self.params + self.others
        agreed_over_ranks({"micro-batches": len(kept),
                           "penalized parameters' entries": sum(int(p.ds_numel) for p in params)},
                          "EnginePenalty under ZeRO-3")
        counts = [partition_range(p)[1] for p in every]
        # ḡ's partitions, this rank's share: the one copy of the gradient the step keeps
        mean = [safe_get_local_grad(p).narrow(0, 0, n).clone() for p, n in zip(every, counts,
                                                                                strict=True)]
        square = torch.stack([t.square().sum() for t in mean[:len(params)]]).sum()
        group = params[0].ds_process_group
        torch.distributed.all_reduce(square, group=group)  # S = ||ḡ||², the same on every rank
        leaf = square.detach().requires_grad_()
        with torch.enable_grad():
            value = penalty._of_norms(leaf if config.squared else leaf.sqrt())
            (slope,) = torch.autograd.grad(value, leaf)
        positive = square > 0
        along_g = torch.where(positive, 2 * slope, 0.0)  # v = along_g ḡ
        length = along_g.abs() * square.sqrt()  # ||v||
        factor = penalty.factor
        penalty.last_value = value.detach()
        weighted = value.detach() * factor
        if config.check_finite:  # as the penalty's own call checks its value
            penalty.finite_check(penalty.last_value, weighted=weighted, factor=factor)
        step = parameter_step(config.step, config.shift, roundoff)
        shift, scale = shift_length(config.shift, step, length, config.gain)
        along = torch.where(length > 0, shift / torch.where(length > 0, length, 1.0), 0.0)
        amount = along * along_g  # θ + h v̂ = θ + amount ḡ

        def whole(held: list[int]) -> list[Tensor]:
            return [_gathered(safe_get_local_grad(params[j]), params[j], group) for j in held]

        with shifted_partitions(params, [amount.to(t.dtype) for t in mean[:len(params)]],
                                lambda j, _start, _count: mean[j], whole):
            engine.optimizer.zero_grad()  # the second pass's first backward copies, not adds
            for p in every:
                zeros = safe_get_local_grad(p).zero_()
                safe_set_local_grad(p, zeros)
            self._second_pass(kept)
        weight = scale * factor  # ḡ + c ||v||/h (ḡ' - ḡ)
        for j, (p, n, g) in enumerate(zip(every, counts, mean, strict=True)):
            local = safe_get_local_grad(p)
            if j < len(params):
                g.lerp_(local.narrow(0, 0, n), weight.to(g.dtype))
            local.narrow(0, 0, n).copy_(g)
            safe_set_local_grad(p, local)
        return weighted

    def _second_pass(self, kept: list[tuple[LossOf, GeneratorState]]) -> None:
        """Each kept micro-batch's forward through the engine from its random state, the
        modules' buffers put back after it (BatchNorm counts each micro-batch once), and the
        engine's backward."""
        engine = self.engine
        buffers = list(engine.module.buffers())
        before = [b.clone() for b in buffers]
        for k, (loss_of, state) in enumerate(kept):
            watch = not self._checked and k == 0
            with state.replayed(), UnreplayedDraws() if watch else nullcontext() as unreplayed:
                loss = loss_of(engine)
            if unreplayed is not None and unreplayed.drawn:
                raise GradientError(
                    "EnginePenalty runs each micro-batch again at the shifted parameters, and "
                    f"its forward draws from {', '.join(sorted(set(unreplayed.drawn)))}, which "
                    "no captured state replays: draw from torch's global generator (dropout, "
                    "torch.rand without generator=).")
            engine.backward(loss)
            if buffers:
                torch._foreach_copy_(buffers, before)
        self._checked = True


def _gathered(local: Tensor, param: Tensor, group: Any) -> Tensor:
    """The whole flattened tensor of which ``local`` is this rank's ZeRO-3 partition (padded
    to equal sizes), by one all-gather over ``group``."""
    parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts).narrow(0, 0, int(param.ds_numel))
