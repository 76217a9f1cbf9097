r"""A parameter penalty in a loop that trains with DeepSpeed's engine (``engine.backward``,
``engine.step``): :class:`EnginePenalty`.

The penalty (``sam``, ``asam``, ``gr``, ``param_grad_norm``, by either method) is that of the
whole optimizer step's gradient :math:`\bar g`, all the micro-batches of the engine's
``gradient_accumulation_steps`` :math:`N` on all the ranks :math:`W`, as DeepSpeed averages
them (each micro-batch's mean loss, equally weighted): a :class:`~gradreg.penalties.Window` of
:math:`N` micro-batches over the ranks with DeepSpeed's own backward
(:func:`deepspeed_backward`). Each call of :meth:`EnginePenalty.backward` takes one
micro-batch: its forward through the engine, then a first phase on the engine's unwrapped
module (a forward, its random numbers the engine forward's: dropout's masks, and a gradient,
:math:`g_k`), kept with its random state; on the step's last micro-batch
(``engine.is_gradient_accumulation_boundary()``) one all-reduce of the ranks' sums gives
:math:`\bar g`, the penalty's value and direction :math:`v`, the same on every rank, and the
second phase over the kept micro-batches gives this rank's :math:`c\,\bar H_r v` (by finite
difference at :math:`\theta + h\hat v`, or by double backward); then ``engine.backward`` of
the loss, plus on the last micro-batch a zero carrying :math:`N c\,\bar H_r v` (the engine
divides by :math:`N`). ZeRO's reduction averages the ranks, which completes :math:`\bar g +
c\,\bar H v`.

Why the penalty's passes run on the unwrapped module: DeepSpeed hooks the outputs of its
engine's forward, and any backward through them, ``torch.autograd.grad`` included, starts its
backward and, when that graph ends, its gradient reduction (DeepSpeed 0.19: an ``IndexError``
in its buckets). The first phase's forward is one more per micro-batch than the step's own.

Taken: ZeRO stages 0, 1 and 2 (the parameters whole on every rank), every parameter penalty;
ZeRO-3 (the parameters partitioned between forwards), the finite differences (``sam``, ``gr``,
``param_grad_norm``'s). Those of the 2-norm, in float32, the optimizer's states not
offloaded, run on each rank's partitions
(:class:`~gradreg.integrations.zero_sharded.ShardedStep`: the engine's own backward of each
micro-batch is the first pass, and at the step's boundary a second pass through the engine at
the shifted partitions; no forward on the unwrapped module, each rank's extra memory one
buffer of its partition); the others with the shift applied to each rank's partition
(:func:`zero3_shifted_parameters`) and the penalty's gradient handed to the parameters
gathered whole (:func:`gathered_whole`), parameter-sized buffers on every rank. Refused in one
line: under ZeRO-3 what :func:`check_zero3` names
(FSDP2 with :func:`gradreg.sharding.penalty_step` takes it), and penalties at other points
(their inner gradient would run through the engine's outputs).
Every rank must call :meth:`~EnginePenalty.backward` on the same micro-batches of the same
steps (the penalty due on all or none): ranks whose penalized parameters differ are refused
in one line (:func:`~gradreg.penalties.accumulation.agreed_over_ranks`).

Importing this module imports no DeepSpeed: the engine is used through ``module``,
``backward``, ``gradient_accumulation_steps()``, ``is_gradient_accumulation_boundary()`` and
``zero_optimization_stage()`` (under ZeRO-3 also ``optimizer``, ``fp16_enabled()``,
``bfloat16_enabled()`` and ``zero_use_cpu_optimizer()``, and its steps read and write the
partitions' gradients through ``deepspeed.utils``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from gradreg.autograd import GradientError
from gradreg.integrations.zero_sharded import ShardedStep, shifted_partitions, takes_sharded
from gradreg.penalties import EngineBackward, GeneratorState, GradientPenalty, Window

__all__ = ["EnginePenalty", "check_zero3", "deepspeed_backward", "gathered_whole",
           "zero3_shifted_parameters"]

LossOf = Callable[[nn.Module], Tensor]


def check_zero3(penalty: GradientPenalty, what: str, works: str) -> None:
    """Refuse in one line what DeepSpeed ZeRO-3 does not take of a parameter penalty
    (``what``: how the message names it; ``works``: what takes it): the exact method (a
    double backward of partitioned parameters) and the adaptive shift (ASAM reads the
    parameters whole)."""
    if not penalty.needs_callable:
        raise GradientError(
            f"{what} (method={penalty.config.method.name!r}) differentiates the parameters "
            "twice, which DeepSpeed ZeRO-3 cannot (its parameters are partitioned between "
            "forwards): use method='finite_difference' (param_grad_norm(λ, "
            f"method='finite_difference'); sam and gr are finite differences), or ZeRO-2, or "
            f"{works}.")
    if getattr(penalty.config.method, "adaptive", False):
        raise GradientError(
            f"{what} is adaptive (ASAM: its direction scales the gradient by the parameters' "
            "magnitudes), which reads the parameters whole, and DeepSpeed ZeRO-3 holds them "
            f"partitioned: use sam or gr, or ZeRO-2, or {works}.")


def gathered_whole(params: Sequence[Tensor]) -> AbstractContextManager:
    """DeepSpeed ZeRO-3's ``GatheredParameters`` of those of ``params`` that it holds
    partitioned (all whole in the block; those held gathered, by a forward whose backward is
    to come or as persistent, are left as they are). Imports DeepSpeed."""
    import deepspeed

    return deepspeed.zero.GatheredParameters([p for p in params if p.data.numel() == 0])


def zero3_shifted_parameters(params: Sequence[Tensor], vectors: Sequence[Tensor],
                             amounts: list[Tensor]) -> AbstractContextManager:
    r"""The block runs at :math:`\theta_j + a_j d_j` on DeepSpeed ZeRO-3's partitioned
    parameters, ``vectors`` :math:`d_j` whole, the same on every rank: each rank shifts its
    partition by its slice of them (:func:`~gradreg.integrations.zero_sharded
    .shifted_partitions`, which puts them back bitwise after it)."""
    flats = [vector.reshape(-1) for vector in vectors]
    return shifted_partitions(params, amounts,
                              lambda j, start, count: flats[j].narrow(0, start, count),
                              lambda held: [flats[j] for j in held])


def deepspeed_backward(stage: int) -> EngineBackward:
    """DeepSpeed's engine as a :class:`~gradreg.penalties.Window` takes it (its own backward
    alone differentiates the task loss): under ZeRO-3 the finite difference shifts each
    rank's partition (:func:`zero3_shifted_parameters`) and the penalty's gradient is handed to
    the parameters gathered whole (:func:`gathered_whole`); below it, the parameters as they
    are."""
    if stage == 3:
        return EngineBackward(shift=zero3_shifted_parameters, whole=gathered_whole)
    return EngineBackward()


class EnginePenalty:
    """``penalty`` (on ``points="parameters"``) of the whole step's gradient in a loop over
    DeepSpeed's ``engine`` (module docstring)::

        sharpness = EnginePenalty(engine, sam(0.05))
        for batch in batches:
            sharpness.backward(lambda module: loss_fn(module(batch.x), batch.y), on=(batch.x,))
            engine.step()

    ``params``: the parameters the penalty is of (the trainable parameters of
    ``engine.module`` where not given; the others take the task's gradient alone).
    ``last_value``: the weighted penalty of the latest finished step."""

    def __init__(self, engine: Any, penalty: GradientPenalty,
                 params: Sequence[Tensor] | None = None) -> None:
        config = penalty.config
        if config.points != "parameters":
            raise GradientError(
                f"EnginePenalty takes penalties on points='parameters' (sam, asam, gr, "
                f"param_grad_norm), got points={config.points!r}: its inner gradient would run "
                "through the DeepSpeed engine's outputs, whose hooks start the engine's "
                "backward; train with DDP or FSDP2 (gradreg.sharding.penalty_step), which take "
                "every penalty.")
        stage = int(engine.zero_optimization_stage())
        if stage == 3:
            check_zero3(penalty, "EnginePenalty",
                        "FSDP2 with gradreg.sharding.penalty_step, which takes it")
        module = engine.module
        self.params = [p for p in module.parameters() if p.requires_grad] if params is None \
            else list(params)
        over_ranks = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        self.engine, self.penalty = engine, penalty
        #: ZeRO-3's finite differences on each rank's partitions (gradreg.integrations
        #: .zero_sharded), else None: the penalty's passes on the unwrapped module
        self.sharded = ShardedStep(engine, penalty, self.params) \
            if stage == 3 and takes_sharded(engine, penalty) else None
        self.window = Window(int(engine.gradient_accumulation_steps()), over_ranks=over_ranks,
                             engine=deepspeed_backward(stage))
        self.last_value: Tensor | None = None

    def backward(self, loss_of: LossOf, *, on: Sequence[Tensor] = ()) -> Tensor:
        r"""One micro-batch: ``loss_of(module)`` is its mean loss computed by calling
        ``module`` (the engine for its backward, the unwrapped module for the penalty's
        passes), ``on`` the batch's tensors whose devices' random states are replayed.
        Runs ``engine.backward`` (the user then calls ``engine.step()``, as after any
        backward) and returns the detached loss. Call it on every micro-batch of a step where
        the penalty is due (``penalty.due()``, once per step), else ``engine.backward``."""
        self.penalty._check_due()
        engine, module = self.engine, self.engine.module
        state = GeneratorState.capture(*on, *self.params)
        loss = loss_of(engine)
        last = engine.is_gradient_accumulation_boundary()
        if self.sharded is not None:  # the step's own backward is the first pass
            self.sharded.add(loss_of, state, loss)
            engine.backward(loss)
            if last:
                self.last_value = self.sharded.finish()
            return loss.detach()
        task, value = self.window.micro_batch("penalty", self.penalty, loss,
                                              lambda: loss_of(module), state, self.params,
                                              last=last)
        if last:
            self.last_value = value
        engine.backward(task)
        return loss.detach()
