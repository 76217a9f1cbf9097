r"""A parameter penalty's finite difference on each rank's shards of the parameters:
:class:`ShardedStep`, the arithmetic that DeepSpeed ZeRO-3
(:mod:`gradreg.integrations.zero_sharded`) and FSDP2 (:class:`gradreg.sharding.ShardedPenalty`)
share; each engine gives it a :class:`Shards`, how to read and write its shards.

The engine holds each parameter sharded over the :math:`W` ranks, and its backward leaves on
each rank the shard of the step's gradient, reduce-scattered and averaged over the ranks and
the :math:`N` micro-batches: rank :math:`r`'s slice :math:`\bar g^{(r)}` of :math:`\bar g`. A
penalty :math:`c\,P(\lVert \bar g \rVert_2)` (``sam``, ``gr``, ``param_grad_norm`` by finite
difference) needs of :math:`\bar g` only

* its squared norm :math:`S = \sum_r \lVert \bar g^{(r)} \rVert^2` (the shards are disjoint),
  one all-reduce of each rank's sum of squares; the value :math:`c\,P` and the direction
  :math:`v = \partial P / \partial \bar g = 2\,P'(S)\,\bar g` (the penalty's own formula,
  :math:`P'` by autograd of the scalar), whose shard :math:`v^{(r)}` is :math:`\bar g^{(r)}`
  times one number, and :math:`\lVert v \rVert = 2 \lvert P'(S)\rvert \sqrt S`;
* the gradient :math:`\bar g'` at :math:`\theta + h \hat v` (:math:`h` by the penalty's
  ``shift`` rule): each rank shifts its shards of the parameters by :math:`h\,v^{(r)}/\lVert v
  \rVert` (:meth:`Shards.shifted`), and a second pass of the step's micro-batches through the
  engine (each forward drawing the random numbers of its first, the modules' buffers kept)
  leaves :math:`\bar g'^{(r)}` in the engine's shards;

and the step's gradient is, on each rank's shard,

.. math::

    \bar g^{(r)} + c\,\frac{\lVert v \rVert}{h} \bigl(\bar g'^{(r)} - \bar g^{(r)}\bigr),

the difference quotient of :class:`~gradreg.penalties.accumulation.Accumulation`, written into
the engine's shards before the optimizer's step: the optimizer, and its gradient clipping, see
this gradient only. The parameters' shards are put back bitwise after the second pass.

It is computed in the engine's own gradient buffers, as :math:`(1 - w)\,\bar g^{(r)} + w\,
\bar g'^{(r)}` (:math:`w = c\,\lVert v \rVert / h`): the shards become :math:`(1 - w)\,\bar
g^{(r)}` after the shift, and the second pass's backwards, of its losses times :math:`w`, add
:math:`w\,\bar g'^{(r)}` to them. Each rank holds one copy of its shards of the penalized
parameters (put back from it bitwise) and of the other parameters' gradients (which take
:math:`\bar g^{(r)}` alone): one shard-sized buffer in all, memory :math:`O(\text{parameters}
/W)`. The first pass is the step's own backward of each micro-batch; the second costs one more
forward and backward per micro-batch, as any finite difference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor

from gradreg.autograd import GradientError
from gradreg.penalties.accumulation import agreed_over_ranks
from gradreg.penalties.guards.precision import unit_roundoff
from gradreg.penalties.mechanism import GradientPenalty
from gradreg.penalties.methods.param_gradient import (
    check_default_step_is_smooth,
    parameter_step,
    shift_length,
)
from gradreg.penalties.state.randomness import GeneratorState, UnreplayedDraws

__all__ = ["ShardedStep", "Shards", "takes_shards"]

LossOf = Callable[[Any], Tensor]


def takes_shards(penalty: GradientPenalty) -> bool:
    """Whether :class:`ShardedStep` computes ``penalty``: a finite difference (no double
    backward) of the 2-norm, its shift along the gradient (not ASAM's, which scales it by the
    parameters' magnitudes)."""
    config = penalty.config
    return (penalty.needs_callable and config.p == 2
            and not getattr(config.method, "adaptive", False))


class Shards(Protocol):
    """One engine's parameters sharded over the ranks, as :class:`ShardedStep` reads and writes
    them. Its lists run over the penalized parameters first, then the module's other trainable
    ones (which take the task's gradient alone), in one order on every call."""

    #: how the messages name the entry (``"EnginePenalty under ZeRO-3"``)
    name: str
    #: what ``loss_of`` is called with in the second pass (the engine, the module)
    target: Any
    #: the process group over which the shards are split (None: one process, whole)
    group: Any

    def entries(self) -> int:
        """The penalized parameters' entries, all ranks' (the same on every rank)."""

    def gradients(self) -> list[Tensor]:
        """This rank's shard of each parameter's gradient now: its own entries, no padding."""

    def set_gradients(self, values: Sequence[Tensor]) -> None:
        """Write ``values`` (shaped as :meth:`gradients`) into the shards of the gradients."""

    def scale_gradients(self, factor: Tensor) -> None:
        """Multiply the penalized parameters' gradients by ``factor`` where the engine keeps
        them (its next backward adds to them)."""

    def shifted(self, directions: Sequence[Tensor], amount: Tensor) -> AbstractContextManager:
        """The block runs at the penalized parameters plus ``amount`` times ``directions`` (this
        rank's shards of them, shaped as :meth:`gradients`); the shards put back bitwise after
        it."""

    def backward(self, loss: Tensor) -> None:
        """The engine's backward of one micro-batch's loss, as the step's own, added to the
        gradients."""

    def buffers(self) -> list[Tensor]:
        """The module's buffers, put back after each forward of the second pass."""


class ShardedStep:
    r"""The penalty ``penalty`` (:func:`takes_shards`) of the step's gradient w.r.t. the
    penalized parameters of ``shards``, on each rank's shards (module docstring): :meth:`add`
    keeps each micro-batch around the engine's backward of its loss, :meth:`finish` (after the
    step's last micro-batch's backward, before the optimizer's step) runs the second pass and
    leaves the step's gradient in the engine's shards. ``count``: how many of ``shards``'
    parameters are penalized (the first)."""

    def __init__(self, shards: Shards, penalty: GradientPenalty, count: int) -> None:
        self.shards, self.penalty, self.count = shards, penalty, count
        self._kept: list[tuple[LossOf, GeneratorState]] = []
        self._roundoff = 0.0
        self._checked = False  # the first step's checks: a smooth loss, replayed draws

    def add(self, loss_of: LossOf, state: GeneratorState, loss: Tensor) -> None:
        """Keep one micro-batch: ``loss_of(shards.target)`` computes its loss, whose forward
        began from ``state``; ``loss`` is that of its first pass (its graph not yet freed)."""
        config = self.penalty.config
        if not (self._kept or self._checked):
            check_default_step_is_smooth(loss, config.step, config.shift, config.adaptive)
        self._kept.append((loss_of, state))
        self._roundoff = max(self._roundoff, unit_roundoff(loss))

    def finish(self) -> Tensor:
        r"""The step's gradient in the engine's shards (module docstring); returns the weighted
        penalty :math:`c\,P(\bar g)` (detached), the same on every rank."""
        penalty, config, shards, count = self.penalty, self.penalty.config, self.shards, self.count
        kept, roundoff = self._kept, self._roundoff
        self._kept, self._roundoff = [], 0.0
        if shards.group is not None:
            agreed_over_ranks({"micro-batches": len(kept),
                               "penalized parameters' entries": shards.entries()}, shards.name)
        gradients = shards.gradients()  # ḡ's shards, the engine's own
        mean, others = gradients[:count], gradients[count:]
        square = torch.stack([t.square().sum() for t in mean]).sum()
        if shards.group is not None:  # S = ||ḡ||², the same on every rank
            torch.distributed.all_reduce(square, group=shards.group)
        leaf = square.detach().requires_grad_()
        with torch.enable_grad():
            value = penalty._of_norms(leaf if config.squared else leaf.sqrt())
            (slope,) = torch.autograd.grad(value, leaf)
        along_g = torch.where(square > 0, 2 * slope, 0.0)  # v = along_g ḡ
        length = along_g.abs() * square.sqrt()  # ||v||
        factor = penalty.factor
        penalty.last_value = value.detach()
        weighted = value.detach() * factor
        if config.check_finite:  # as the penalty's own call checks its value
            penalty.finite_check(penalty.last_value, weighted=weighted, factor=factor)
        step = parameter_step(config.step, config.shift, roundoff)
        shift, scale = shift_length(config.shift, step, length, config.gain)
        along = torch.where(length > 0, shift / torch.where(length > 0, length, 1.0), 0.0)
        weight = scale * factor  # w: the step's gradient ḡ + w (ḡ' - ḡ) = (1 - w) ḡ + w ḡ'
        # the other parameters' ḡ kept (with the penalized parameters' shards, which the shift
        # keeps to put them back, one shard-sized copy in all); the penalized ones' gradients
        # become (1 - w) ḡ in the engine's buffers, to which the second pass adds w ḡ'
        kept_others = [t.clone() for t in others]
        with shards.shifted(mean, along * along_g):  # θ + h v̂ = θ + amount ḡ
            shards.scale_gradients(1 - weight)
            self._second_pass(kept, weight)
        shards.set_gradients(shards.gradients()[:count] + kept_others)
        return weighted

    def _second_pass(self, kept: list[tuple[LossOf, GeneratorState]], weight: Tensor) -> None:
        """Each kept micro-batch's forward from its random state, the modules' buffers put back
        after it (BatchNorm counts each micro-batch once), and the engine's backward of its loss
        times ``weight``, added to the gradients."""
        shards = self.shards
        buffers = shards.buffers()
        before = [b.clone() for b in buffers]
        for k, (loss_of, state) in enumerate(kept):
            watch = not self._checked and k == 0
            with state.replayed(), UnreplayedDraws() if watch else nullcontext() as unreplayed:
                loss = loss_of(shards.target)
            if unreplayed is not None and unreplayed.drawn:
                raise GradientError(
                    f"{shards.name} runs each micro-batch again at the shifted parameters, "
                    f"and its forward draws from "
                    f"{', '.join(sorted(set(unreplayed.drawn)))}, which no captured state "
                    "replays: draw from torch's global generator (dropout, torch.rand without "
                    "generator=).")
            shards.backward(loss * weight.to(loss.dtype))
            if buffers:
                torch._foreach_copy_(buffers, before)
        self._checked = True
