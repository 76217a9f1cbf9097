r"""One training step's terms: which entry point for which penalty, in one place.

For a model :math:`f`, a per-sample loss :math:`\ell_i = \ell(f(x_i), y_i)` and penalties
:math:`P_k`, a step minimizes

.. math::

    L + \sum_k P_k, \qquad L = \frac1B \sum_i \ell_i,

and a trainer differentiates the terms once. :func:`penalty_terms` decides them from a forward
the trainer ran (a :class:`StepForward`), each penalty taken where its ``points`` say and by
the entry its method needs:

* ``"inputs"``: at the forward's points :math:`x` (the model's inputs, or a language model's
  input embeddings), of the outputs :math:`f(x_i)` (``of="outputs"``) or of :math:`\ell_i`
  (``of="loss"``), given as one :class:`~gradreg.penalties.SharedForward` (double backward
  differentiates the task's forward; the estimates replay its random state at the other
  points; the rest run the model again);
* ``"activations"``: at the outputs of the named submodules (``layers``), of the outputs or of
  :math:`\ell_i`;
* ``"parameters"``: of :math:`g = \nabla_\theta L`. By double backward, of the task's graph; by
  finite difference, in two passes (:func:`~gradreg.penalties.penalized_loss`: the task term
  carries :math:`g + c\,Hv` and the penalty only its value); and, in a :class:`Window` of
  micro-batches or ranks, of the whole window's gradient :math:`\bar g` in two phases
  (:mod:`~gradreg.penalties.accumulation`: each micro-batch's task term carries its
  :math:`g_k`, the last one's also :math:`N c\,\bar H v`). Parameters outside the penalty's
  (``others``) take the task's gradient alone, carried beside it where the penalty's passes
  free the task's graph.

:func:`step_terms` is the whole step for a model called on a batch: it runs the forward (with
double-backward attention, :func:`~gradreg.differentiable_attention`, where a due penalty
differentiates its graph twice; the named activations captured; the random state it begins
with captured for the forwards a penalty runs again) and calls :func:`penalty_terms`. A trainer
that runs its own forward (Hugging Face's, whose points are the input embeddings) builds the
:class:`StepForward` and calls :func:`penalty_terms` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gradreg.attention import differentiable_attention
from gradreg.autograd import GradientError, capture
from gradreg.penalties.accumulation import Accumulation, Shift, combined
from gradreg.penalties.mechanism import GradientPenalty
from gradreg.penalties.methods.param_gradient import LossAt, shifted_parameters
from gradreg.penalties.points import as_points
from gradreg.penalties.state.randomness import GeneratorState, SharedForward
from gradreg.penalties.two_pass import Carried, penalized_loss
from gradreg.sharding import held_unsharded

__all__ = ["EngineBackward", "StepForward", "StepTerms", "Window", "penalty_terms",
           "step_terms"]

#: Where :func:`penalty_terms` takes penalties.
STEP_POINTS = ("inputs", "activations", "parameters")


def _as_they_are(_params: Sequence[Tensor]) -> AbstractContextManager:
    return nullcontext()


@dataclass(frozen=True)
class EngineBackward:
    r"""A :class:`Window` whose task loss only an engine's own backward may differentiate
    (DeepSpeed: its hooks on the outputs of its forward start its backward, and its gradient
    reduction when that graph ends, on any backward through them): each micro-batch's first
    phase runs a forward of its own (the ``fn`` of :meth:`Window.micro_batch`), and the task
    term is the loss itself plus a zero whose backward carries the penalty's gradient.
    ``shift``: how the finite difference shifts the parameters
    (:data:`~gradreg.penalties.accumulation.Shift`; ZeRO-3: each rank's partition);
    ``whole``: the context the penalty's gradient is handed to the parameters in (ZeRO-3: the
    parameters gathered whole, the shapes its backward gives).
    :func:`gradreg.integrations.engine_penalty.deepspeed_backward` builds DeepSpeed's.

    Examples:
        One micro-batch; the caller's backward (the engine's) differentiates the loss as it
        is, and the zero beside it carries SAM's part of the step:

        >>> import torch, torch.nn.functional as F
        >>> from gradreg.penalties import EngineBackward, GeneratorState, Window, sam
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Linear(4, 3)
        >>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        >>> def loss() -> torch.Tensor:
        ...     return F.cross_entropy(model(x), y)
        >>> window = Window(1, engine=EngineBackward())
        >>> state = GeneratorState.capture(x)
        >>> task, value = window.micro_batch("sam", sam(0.05), loss(), loss, state,
        ...                                  list(model.parameters()), last=True)
        >>> task.backward()  # .grad = ∇L(θ + ρ ĝ), SAM's step
        >>> bool(value > 0)
        True
    """

    shift: Shift = shifted_parameters
    whole: Callable[[Sequence[Tensor]], AbstractContextManager] = _as_they_are


class Window:
    r"""The micro-batches and ranks one optimizer step's gradient is the mean over: ``size``
    micro-batches per step (gradient accumulation), on each of the ranks of
    ``torch.distributed``'s default group where ``over_ranks`` (each holding an equal share of
    the batch, or ``rows`` of it). Each micro-batch's backward is of :math:`\frac1N` (task +
    penalties), its task loss :math:`L_k` a mean over the micro-batch; ``normalized``: the
    :math:`L_k` are normalized over the window's batch instead (they sum to its loss, as
    Hugging Face's trainer divides by ``num_items_in_batch``), and each backward is of the
    terms as they are. ``engine``: an engine whose own backward alone differentiates the task
    loss (:class:`EngineBackward`; a window of one micro-batch on one process is then divided
    too).

    A parameter penalty is then that of the whole window's gradient (one parameter penalty);
    the window keeps each micro-batch's first phase until the last (:class:`~gradreg
    .penalties.accumulation.Accumulation`), so keep one window for the training run and
    :meth:`clear` it where a run starts again. A per-sample penalty at points is the mean over
    the window's samples (micro-batches of equal size), with ``reduction="sum"`` the sum.

    Examples:
        Two micro-batches per optimizer step; SAM's radius taken along the gradient of both:

        >>> import torch, torch.nn.functional as F
        >>> from functools import partial
        >>> from gradreg.penalties import Window, sam, step_terms
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> penalties, window = {"sam": sam(0.05)}, Window(2)
        >>> for k, rows in enumerate((slice(0, 8), slice(8, 16))):
        ...     terms = step_terms(penalties, model, partial(F.cross_entropy, reduction="none"),
        ...                        x[rows], y[rows], accumulation=window, last=k == 1)
        ...     (terms.total() / 2).backward()
        ...     print(sorted(terms.penalties))  # the penalty on the last micro-batch
        []
        ['sam']
    """

    def __init__(self, size: int = 1, *, over_ranks: bool = False, normalized: bool = False,
                 engine: EngineBackward | None = None) -> None:
        if not (isinstance(size, int) and size >= 1):
            raise GradientError(f"Window(size={size!r}): the number of micro-batches per "
                                "optimizer step is an integer >= 1.")
        self.size, self.over_ranks = size, over_ranks
        self.normalized, self.engine = normalized, engine
        self._phases: dict[str, Accumulation] = {}

    @property
    def divided(self) -> bool:
        """Whether the step's batch is divided at all (into micro-batches or over ranks), or
        its task loss is an engine's to differentiate."""
        return self.size > 1 or self.over_ranks or self.engine is not None

    def _check(self, due: Mapping[str, GradientPenalty], last: bool | None) -> None:
        """Refuse what a divided window cannot take: more than one parameter penalty, a maximum
        over samples split into micro-batches, a micro-batch not saying whether it is the
        last."""
        parameter = sorted(name for name, gp in due.items() if gp.config.points == "parameters")
        where = " and ".join(
            ([f"{self.size} micro-batches per optimizer step (gradient accumulation)"]
             if self.size > 1 else [])
            + (["the batch split over processes"] if self.over_ranks else [])
            + (["an engine's own backward"] if self.engine is not None else []))
        if len(parameter) > 1:
            raise GradientError(
                f"penalties {parameter} with {where}: the penalty of the whole step's gradient "
                "is taken for one parameter penalty; use one, or one batch of the whole size "
                "in one process.")
        maximum = sorted(name for name, gp in due.items() if gp.config.points != "parameters"
                         and gp.config.reduction == "max")
        if maximum and self.size > 1:
            raise GradientError(
                f"penalties {maximum} take the maximum over samples, which {where} splits into "
                "maxima over micro-batches: use reduction='mean' or 'sum', or one micro-batch "
                "of the whole size.")
        if last is None:
            raise GradientError("a step in a Window needs last=True on the micro-batch after "
                                "which the optimizer steps, last=False on the others.")

    def clear(self) -> None:
        """Forget the micro-batches kept (a run starting again)."""
        self._phases.clear()

    @property
    def _factor(self) -> int:
        """What a micro-batch's task loss is multiplied by to be its mean loss."""
        return self.size if self.normalized else 1

    def scaled(self, penalty: GradientPenalty, value: Tensor) -> Tensor:
        r"""A micro-batch's weighted per-sample penalty at points as its backward takes it
        beside the task: the mean over the window's samples is :math:`\frac1N` of the
        micro-batches' means (``normalized``: the :math:`\frac1N` is here, else in the
        backward), a sum over them :math:`N` times that."""
        config = penalty.config
        weight = (self.size if config.reduction == "sum" and config.per_sample else 1) \
            / self._factor
        return value if weight == 1 else value * weight

    def micro_batch(self, name: str, penalty: GradientPenalty, loss: Tensor,
                    fn: Callable[[], Tensor], state: GeneratorState, params: Sequence[Tensor],
                    *, last: bool, rows: int | None = None, retain_graph: bool = False,
                    hand_over: bool = True) -> tuple[Tensor, Tensor | None]:
        r"""One micro-batch of the parameter penalty ``penalty`` (``name``: the window keeps
        its phases by name) of the window's gradient w.r.t. ``params``: ``loss`` the micro-batch's
        task loss :math:`L_k`, ``fn()`` computes it again at the parameters' current values
        (the forward's random ``state`` replayed), ``rows`` its number of samples where shares
        differ. Returns the task term, carrying :math:`g_k` (and on the ``last`` micro-batch
        also :math:`N c\,\bar H v`), and on the last the weighted penalty :math:`c\,P(\bar
        g)` (detached; None before). ``hand_over``: the term's backward hands its gradients
        to ``.grad`` (False: they are kept, for a graph differentiated again)."""
        phases = self._phases.get(name)
        engine = self.engine
        if phases is None:  # FSDP2: the parameters held gathered
            phases = self._phases[name] = Accumulation(
                penalty, held_unsharded(tuple(params), "a parameter penalty"),
                over_ranks=self.over_ranks,
                shift=shifted_parameters if engine is None else engine.shift)
        factor = self._factor
        twice = not penalty.needs_callable  # the second phase differentiates fn's graph twice

        def mean_loss() -> Tensor:
            with differentiable_attention() if twice else nullcontext():
                return fn() * factor if factor != 1 else fn()

        given = None if engine is not None else (loss * factor if factor != 1 else loss)
        g = phases.add(mean_loss, state, given, rows=rows, retain_graph=retain_graph)
        if engine is not None:  # the engine's backward of the loss gives the task's gradient
            g = [None] * len(g)
        value = None
        if last:
            value, hv = phases.finish()
            g = combined(g, hv, self.size)
        if factor != 1:
            g = [None if t is None else t.div_(factor) for t in g]
        if engine is None:
            return Carried.apply(loss.detach(), g, hand_over, *phases.params), value
        if all(t is None for t in g):
            return loss, value
        with engine.whole(phases.params):
            carried = Carried.apply(loss.detach().new_zeros(()), g, True, *phases.params)
        return loss + carried, value


@dataclass
class StepForward:
    r"""A training step's forward as its trainer ran it, what :func:`penalty_terms` needs:
    ``task``, the task loss :math:`L` (its graph; a micro-batch's :math:`L_k` in a window);
    ``outputs``, the model's outputs, batch first; ``losses``, the per-sample losses
    :math:`\ell_i`, or a function computing them (called once, where a penalty needs them);
    ``state``, the random state the forward began with; ``again``, :math:`L` computed again at
    the parameters' current values (for the parameter penalties: the forward's random state
    replayed around it). For penalties at the inputs: ``points``, the tensor the forward
    computed from (made to require grad), and ``outputs_at(points, *point_args)`` and
    ``losses_at(points, *point_args)`` running the forward at other points, ``point_args``
    the batch's per-sample tensors passed along. For penalties at activations:
    ``activations``, the captured outputs of the named submodules.

    Examples:
        A forward whose per-sample losses are computed where a penalty needs them:

        >>> import torch, torch.nn.functional as F
        >>> from gradreg.penalties import GeneratorState, StepForward, penalty_terms, sam
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Linear(4, 3)
        >>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        >>> state = GeneratorState.capture(x)
        >>> outputs = model(x)
        >>> forward = StepForward(F.cross_entropy(outputs, y), outputs,
        ...                       lambda: F.cross_entropy(outputs, y, reduction="none"), state,
        ...                       lambda: F.cross_entropy(model(x), y))
        >>> terms = penalty_terms({"sam": sam(0.05)}, forward, list(model.parameters()))
        >>> terms.losses is None  # no penalty needed them
        True
        >>> terms.total().backward()
    """

    task: Tensor
    outputs: Tensor
    losses: Tensor | Callable[[], Tensor]
    state: GeneratorState
    again: Callable[[], Tensor]
    points: Tensor | None = None
    outputs_at: Callable[..., Tensor] | None = None
    losses_at: Callable[..., Tensor] | None = None
    point_args: tuple[Tensor, ...] = ()
    activations: Mapping[str, Tensor] = field(default_factory=dict)

    def per_sample(self) -> Tensor:
        """:math:`\\ell_i`, computed on first use."""
        if callable(self.losses):
            self.losses = self.losses()
        return self.losses


@dataclass
class StepTerms:
    """What :func:`step_terms` and :func:`penalty_terms` return: ``task``, the mean task loss
    :math:`L` (carrying the gradients the parameter penalties took on their way, as its
    backward adds them); ``penalties``, the weighted penalties due at this step by name (a
    parameter penalty in a window: on its last micro-batch only); ``outputs``, the model's
    outputs; ``losses``, the per-sample losses :math:`\\ell_i` (None where the forward gave a
    function for them and no penalty needed them).

    Examples:
        >>> import torch, torch.nn.functional as F
        >>> from functools import partial
        >>> from gradreg.penalties import double_backprop, step_terms
        >>> model = torch.nn.Linear(2, 3)
        >>> x, y = torch.randn(5, 2), torch.tensor([0, 1, 2, 0, 1])
        >>> terms = step_terms({"db": double_backprop(0.1)}, model,
        ...                    partial(F.cross_entropy, reduction="none"), x, y)
        >>> terms.outputs.shape, terms.losses.shape, list(terms.penalties)
        (torch.Size([5, 3]), torch.Size([5]), ['db'])
        >>> torch.equal(terms.total(), terms.task + terms.penalties["db"])
        True
    """

    task: Tensor
    outputs: Tensor
    losses: Tensor | None
    penalties: dict[str, Tensor] = field(default_factory=dict)

    def total(self) -> Tensor:
        """``task + Σ penalties``, the step's loss to differentiate once."""
        return self.task + sum(self.penalties.values())


def step_terms(penalties: Mapping[str, GradientPenalty], model: Callable[[Tensor], Tensor],
               loss: Callable[..., Tensor], x: Tensor, *targets: Tensor,
               params: Sequence[Tensor] | None = None, accumulation: Window | None = None,
               last: bool | None = None, rows: int | None = None,
               loss_scale: float | Tensor | None = None, split: bool = False) -> StepTerms:
    r"""One training step's forward and its terms (module docstring): :math:`L` and each
    penalty due (``penalty.due()``, called once here for each), as :class:`StepTerms`; one
    backward of :meth:`StepTerms.total` gives the step's gradient.

    ``model(x)``: the outputs, batch first; ``loss(outputs, *targets)``: the per-sample losses
    ``[B]`` (``partial(F.cross_entropy, reduction="none")``); ``params``: the parameters the
    parameter penalties are of (the model's trainable ones where not given; where the model is
    a module, its other trainable parameters take the task's gradient alone).
    ``accumulation``, ``last``, ``rows``, ``loss_scale``, ``split``: as :func:`penalty_terms`
    takes them.

    Examples:
        A plain loop with SAM and double backprop; the penalties not due (``every``) are left
        out:

        >>> import torch, torch.nn.functional as F
        >>> from functools import partial
        >>> from gradreg.penalties import double_backprop, sam, step_terms
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> penalties = {"sam": sam(0.05), "db": double_backprop(0.1, every=2)}
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> ce = partial(F.cross_entropy, reduction="none")
        >>> for _ in range(3):
        ...     x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        ...     terms = step_terms(penalties, model, ce, x, y)
        ...     terms.total().backward()
        ...     optimizer.step()
        ...     optimizer.zero_grad()
        ...     print(sorted(terms.penalties))
        ['db', 'sam']
        ['sam']
        ['db', 'sam']
    """
    if accumulation is not None and accumulation.size > 1:  # due() counts each micro-batch
        lazy = sorted(name for name, gp in penalties.items()
                      if gp.config.points == "parameters" and gp.config.every > 1)
        if lazy:
            raise GradientError(
                f"penalties {lazy} in a Window of {accumulation.size} micro-batches are lazy "
                "(every > 1), and step_terms calls due() on each micro-batch, which counts it "
                "as a step: the penalty of the whole window's gradient is computed at every "
                "step (every=1).")
    due = {name: gp for name, gp in penalties.items() if gp.due()}
    _check_points(due, "step_terms")
    if any(gp.config.points == "inputs" for gp in due.values()):
        x = as_points(x)
    layers = sorted({layer for gp in due.values() for layer in gp.config.layers})
    if layers and not isinstance(model, nn.Module):
        raise GradientError(f"penalties at layers {layers} capture a submodule's outputs: pass "
                            "the model as an nn.Module.")
    trainable = [p for p in model.parameters() if p.requires_grad] \
        if isinstance(model, nn.Module) else []
    if params is None and any(gp.config.points == "parameters" for gp in due.values()):
        if not isinstance(model, nn.Module):
            raise GradientError("a parameter penalty is of the gradient of the model's "
                                "parameters: pass params=[...] or the model as an nn.Module.")
        params = trainable
    # a penalty that differentiates this forward's graph twice needs attention with a double
    # backward; without one due, the task keeps the fused kernels
    twice = any(not gp.needs_callable for gp in due.values())
    state = GeneratorState.capture(x)  # replayed where a penalty runs the model at other points
    with (differentiable_attention() if twice else nullcontext(),
          capture(model, *layers) if layers else nullcontext({}) as activations):
        outputs = model(x)
    losses = loss(outputs, *targets)

    def mean_loss() -> Tensor:  # L at the parameters' current values
        return loss(model(x), *targets).mean()

    def outputs_at(points: Tensor, *_targets: Tensor) -> Tensor:
        return model(points)

    def losses_at(points: Tensor, *at_targets: Tensor) -> Tensor:
        return loss(model(points), *at_targets)

    forward = StepForward(losses.mean(), outputs, losses, state, mean_loss, points=x,
                          outputs_at=outputs_at, losses_at=losses_at, point_args=targets,
                          activations=activations)
    chosen = set(map(id, params or ()))
    return penalty_terms(due, forward, params or (),
                         others=[p for p in trainable if id(p) not in chosen],
                         window=accumulation, last=last, rows=rows, loss_scale=loss_scale,
                         split=split)


def penalty_terms(due: Mapping[str, GradientPenalty], forward: StepForward,
                  params: Sequence[Tensor] = (), *, others: Sequence[Tensor] = (),
                  window: Window | None = None, last: bool | None = None,
                  rows: int | None = None, loss_scale: float | Tensor | None = None,
                  split: bool = False) -> StepTerms:
    r"""The terms of the penalties ``due`` at this step (each once; ``penalty.due()`` already
    decided) on a forward the trainer ran (:class:`StepForward`), as :class:`StepTerms`; one
    backward of :meth:`StepTerms.total` gives the step's gradient (module docstring).

    ``params``: the parameters the parameter penalties are of; ``others``: the trainable
    parameters outside them, which take the task's gradient alone. ``window``: the
    :class:`Window` the step is a micro-batch of, ``last`` (required there) whether the
    optimizer steps after it, ``rows`` its number of samples where the window's shares differ
    (each backward then of :math:`\frac1N` of the total). ``loss_scale``: a ``GradScaler``'s
    scale under fp16 autocast, for the penalties at points. ``split``: each term carries its
    own gradient (a per-term gradient split: one parameter-sized buffer more), not the task
    term the parameter penalties' too.

    Under DeepSpeed (a window with an :class:`EngineBackward`) the parameter penalties' passes
    run ``forward.again`` (on the unwrapped model), never through the task's graph.

    Examples:
        A trainer's own forward, its points the first layer's outputs (as a language model's
        are its input embeddings):

        >>> import torch, torch.nn.functional as F
        >>> from gradreg.penalties import (GeneratorState, StepForward, double_backprop,
        ...                                penalty_terms)
        >>> torch.manual_seed(0) and None
        >>> embed, head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
        >>> x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        >>> state = GeneratorState.capture(x)
        >>> e = embed(x)
        >>> outputs = head(e)
        >>> losses = F.cross_entropy(outputs, y, reduction="none")
        >>> forward = StepForward(losses.mean(), outputs, losses, state,
        ...                       lambda: F.cross_entropy(head(embed(x)), y), points=e)
        >>> terms = penalty_terms({"db": double_backprop(0.1)}, forward)
        >>> terms.total().backward()
        >>> list(terms.penalties), embed.weight.grad.shape
        (['db'], torch.Size([8, 4]))
    """
    _check_points(due, "penalty_terms")
    divided = window is not None and window.divided
    if divided:
        window._check(due, last)
    mean = forward.task
    terms = StepTerms(mean, forward.outputs, None if callable(forward.losses) else forward.losses)
    if not due:
        return terms
    params = list(params)
    parameter = [gp for gp in due.values() if gp.config.points == "parameters"]
    retain = len(due) > 1  # other terms differentiate the same forward
    # where the penalty's passes free the task's graph and carry its gradient for ``params``,
    # the others' gradient is taken first, kept beside it
    replaced = bool(parameter) and (window.engine is None if divided
                                    else any(gp.needs_callable for gp in parameter))
    beside = _carried_gradient(mean, list(held_unsharded(tuple(others), "a parameter penalty"))
                               ) if replaced and others else None
    for name, gp in due.items():
        points = gp.config.points
        if points == "inputs":
            value = _at_inputs(gp, forward, loss_scale)
        elif points == "activations":
            of = forward.per_sample() if gp.config.of == "loss" else forward.outputs
            value = gp(of, [forward.activations[layer] for layer in gp.config.layers],
                       loss_scale=loss_scale)
        elif divided:  # of the window's gradient
            terms.task, value = window.micro_batch(
                name, gp, mean, forward.again, forward.state, params, last=bool(last),
                rows=rows, retain_graph=retain, hand_over=not split)
            if value is None:  # not the last micro-batch: the penalty is still to come
                continue
        elif gp.needs_callable and terms.task is mean:  # two passes, the task's gradient
            terms.task, value = penalized_loss(gp, LossAt(forward.again, mean, forward.state),
                                               held_unsharded(tuple(params), "a parameter "
                                                              "penalty"),
                                               retain_graph=retain, split=split)
        else:
            at = LossAt(forward.again, mean, forward.state) if gp.needs_callable else mean
            value = gp(at, held_unsharded(tuple(params), "a parameter penalty"),
                       loss_scale=loss_scale)
        if divided and points != "parameters":
            value = window.scaled(gp, value)
        terms.penalties[name] = value
    if forward.losses is not None and not callable(forward.losses):
        terms.losses = forward.losses
    if beside is not None:
        terms.task = terms.task + beside
    return terms


def _check_points(due: Mapping[str, GradientPenalty], what: str) -> None:
    refused = sorted(name for name, gp in due.items() if gp.config.points not in STEP_POINTS)
    if refused:
        raise GradientError(
            f"{what} takes penalties at points {list(STEP_POINTS)}; {refused} are at "
            "a GAN's points: call them as penalty(D(points), points) in the GAN's loss.")


def _at_inputs(gp: GradientPenalty, forward: StepForward,
               loss_scale: float | Tensor | None) -> Tensor:
    """The weighted penalty ``gp`` at the forward's points, of its outputs or per-sample losses
    (the forward shared where the method can)."""
    if forward.points is None:
        raise GradientError(f"a penalty at the inputs ({gp.config.points!r}) needs the "
                            "forward's points: give StepForward(points=...).")
    if gp.config.of == "outputs":
        shared = SharedForward(forward.outputs_at, forward.points, forward.outputs,
                               forward.state)
    else:
        shared = SharedForward(forward.losses_at, forward.points, forward.per_sample(),
                               forward.state)
    return gp(shared, forward.points, loss_scale=loss_scale, fn_args=forward.point_args)


def _carried_gradient(loss: Tensor, params: list[Tensor]) -> Tensor:
    """A zero whose backward adds the gradient of ``loss`` to ``params``; the graph is kept."""
    g = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return Carried.apply(loss.detach().new_zeros(()), list(g), True, *params)
