r"""One training step's terms: which entry point for which penalty, in one place.

For a model :math:`f`, a per-sample loss :math:`\ell_i = \ell(f(x_i), y_i)` and penalties
:math:`P_k`, a step minimizes

.. math::

    L + \sum_k P_k, \qquad L = \frac1B \sum_i \ell_i,

and :func:`step_terms` runs the forward once and returns the terms a trainer adds and
differentiates once, each penalty taken where its ``points`` say and by the entry its method
needs:

* ``"inputs"``: at :math:`x` (made a point), of the outputs :math:`f(x_i)` (``of="outputs"``) or
  of :math:`\ell_i` (``of="loss"``), given as one
  :class:`~gradreg.penalties.SharedForward` (double backward differentiates the task's forward;
  the estimates replay its random state at the other points; the rest run the model again);
* ``"activations"``: at the outputs of the named submodules (``layers``), of :math:`\ell_i`;
* ``"parameters"``: of :math:`g = \nabla_\theta L`. By double backward, of the task's graph; by
  finite difference, in two passes (:func:`~gradreg.penalties.penalized_loss`: the task term
  carries :math:`g + c\,Hv` and the penalty only its value); and, in a :class:`Window` of
  micro-batches or ranks, of the whole window's gradient
  :math:`\bar g` in two phases (:mod:`~gradreg.penalties.accumulation`: each micro-batch's task
  term carries its :math:`g_k`, the last one's also :math:`N c\,\bar H v`).

The forward runs with double-backward attention (:func:`~gradreg.differentiable_attention`)
where a due penalty differentiates its graph twice, the named activations captured, and the
random state it begins with captured for the forwards a penalty runs again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

from torch import Tensor, nn

from gradreg.attention import differentiable_attention
from gradreg.autograd import GradientError, capture
from gradreg.penalties.accumulation import Accumulation, combined
from gradreg.penalties.mechanism import GradientPenalty
from gradreg.penalties.methods.param_gradient import LossAt
from gradreg.penalties.points import as_points
from gradreg.penalties.state.randomness import GeneratorState, SharedForward
from gradreg.penalties.two_pass import Carried, penalized_loss
from gradreg.sharding import held_unsharded

__all__ = ["StepTerms", "Window", "step_terms"]

#: Where :func:`step_terms` takes penalties.
STEP_POINTS = ("inputs", "activations", "parameters")


class Window:
    r"""The micro-batches and ranks one optimizer step's gradient is the mean over: ``size``
    micro-batches per step (gradient accumulation, each backward of :math:`\frac1N` (task +
    penalties)), on each of the ranks of ``torch.distributed``'s default group where
    ``over_ranks`` (each holding an equal share of the batch, or ``rows`` of it). A parameter
    penalty is then that of the whole window's gradient (one parameter penalty, ``every=1``);
    the window keeps each micro-batch's first phase until the last (:class:`~gradreg.penalties
    .accumulation.Accumulation`), so keep one window for the training run and :meth:`clear` it
    where a run starts again.

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

    def __init__(self, size: int = 1, *, over_ranks: bool = False) -> None:
        if not (isinstance(size, int) and size >= 1):
            raise GradientError(f"Window(size={size!r}): the number of micro-batches per "
                                "optimizer step is an integer >= 1.")
        self.size, self.over_ranks = size, over_ranks
        self._phases: dict[str, Accumulation] = {}

    @property
    def divided(self) -> bool:
        """Whether the step's batch is divided at all (into micro-batches or over ranks)."""
        return self.size > 1 or self.over_ranks

    def _check(self, penalties: Mapping[str, GradientPenalty], last: bool | None) -> None:
        """Refuse what a divided window cannot take: more than one parameter penalty, a lazy one
        (``every > 1``) over micro-batches (each would count a step), a micro-batch not saying
        whether it is the last."""
        parameter = sorted(name for name, gp in penalties.items()
                           if gp.config.points == "parameters")
        lazy = self.size > 1 and any(penalties[name].config.every > 1 for name in parameter)
        if len(parameter) > 1 or lazy:
            raise GradientError(
                f"penalties {parameter} in a Window of {self.size} micro-batch(es)"
                f"{' over ranks' if self.over_ranks else ''}: the penalty of the whole window's "
                "gradient is taken for one parameter penalty (computed at every step, every=1, "
                "over micro-batches); use one, or a batch of the whole size.")
        if last is None:
            raise GradientError("step_terms in a Window needs last=True on the micro-batch after "
                                "which the optimizer steps, last=False on the others.")

    def clear(self) -> None:
        """Forget the micro-batches kept (a run starting again)."""
        self._phases.clear()

    def _micro_batch(self, name: str, penalty: GradientPenalty, loss: Tensor,
                     fn: Callable[[], Tensor], state: GeneratorState, params: Sequence[Tensor],
                     *, last: bool, rows: int | None, retain_graph: bool, hand_over: bool
                     ) -> tuple[Tensor, Tensor | None]:
        r"""The task term carrying :math:`g_k` (and on the ``last`` micro-batch also :math:`N
        c\,\bar H v`), and on the last the weighted penalty :math:`c\,P(\bar g)`."""
        phases = self._phases.get(name)
        if phases is None:  # FSDP2: the parameters held gathered
            phases = self._phases[name] = Accumulation(
                penalty, held_unsharded(tuple(params), "a parameter penalty"),
                over_ranks=self.over_ranks)
        g = phases.add(fn, state, loss, rows=rows, retain_graph=retain_graph)
        value = None
        if last:
            value, hv = phases.finish()
            g = combined(g, hv, self.size)
        return Carried.apply(loss.detach(), g, hand_over, *phases.params), value


@dataclass
class StepTerms:
    """What :func:`step_terms` returns: ``task``, the mean task loss :math:`L` (carrying the
    gradients the parameter penalties took on their way, as its backward adds them);
    ``penalties``, the weighted penalties due at this step by name (a parameter penalty in a
    window: on its last micro-batch only); ``outputs``, the model's outputs; ``losses``, the
    per-sample losses :math:`\\ell_i`.

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
    losses: Tensor
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
    ``[B]`` (``partial(F.cross_entropy, reduction="none")``); ``params``: the trainable
    parameters the parameter penalties are of (the model's where it is a module and they are not
    given). ``accumulation``: the :class:`Window` the step is a micro-batch of, ``last``
    (required there) whether the optimizer steps after it, ``rows`` its number of samples where
    the window's shares differ (each backward then of :math:`\frac1N` of the total; a
    per-sample penalty with ``reduction="sum"`` is multiplied by :math:`N`, a sum over the
    window). ``loss_scale``: a
    ``GradScaler``'s scale under fp16 autocast, for the penalties at points. ``split``: each term
    carries its own gradient (a per-term gradient split: one parameter-sized buffer more), not
    the task term the parameter penalties' too.

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
    divided = accumulation is not None and accumulation.divided
    if divided:
        accumulation._check(penalties, last)
    due = {name: gp for name, gp in penalties.items() if gp.due()}
    refused = sorted(name for name, gp in due.items() if gp.config.points not in STEP_POINTS)
    if refused:
        raise GradientError(
            f"step_terms takes penalties at points {list(STEP_POINTS)}; {refused} are at "
            "a GAN's points: call them as penalty(D(points), points) in the GAN's loss.")
    if any(gp.config.points == "inputs" for gp in due.values()):
        x = as_points(x)
    layers = sorted({layer for gp in due.values() for layer in gp.config.layers})
    if layers and not isinstance(model, nn.Module):
        raise GradientError(f"penalties at layers {layers} capture a submodule's outputs: pass "
                            "the model as an nn.Module.")
    if params is None and any(gp.config.points == "parameters" for gp in due.values()):
        if not isinstance(model, nn.Module):
            raise GradientError("a parameter penalty is of the gradient of the model's "
                                "parameters: pass params=[...] or the model as an nn.Module.")
        params = [p for p in model.parameters() if p.requires_grad]
    # a penalty that differentiates this forward's graph twice needs attention with a double
    # backward; without one due, the task keeps the fused kernels
    shared = any(not gp.needs_callable for gp in due.values())
    state = GeneratorState.capture(x)  # replayed where a penalty runs the model at other points
    with (differentiable_attention() if shared else nullcontext(),
          capture(model, *layers) if layers else nullcontext({}) as activations):
        outputs = model(x)
    losses = loss(outputs, *targets)
    mean = losses.mean()
    terms = StepTerms(mean, outputs, losses)
    if not due:
        return terms
    size = 1 if accumulation is None else accumulation.size
    retain = len(due) > 1  # other terms differentiate the same forward

    def mean_loss() -> Tensor:  # L at the parameters' current values
        return loss(model(x), *targets).mean()

    for name, gp in due.items():
        points = gp.config.points
        if points == "inputs":
            shared_forward, fn_args = (
                (SharedForward(model, x, outputs, state), ()) if gp.config.of == "outputs"
                else (SharedForward(_per_sample_loss(model, loss), x, losses, state), targets))
            value = gp(shared_forward, x, loss_scale=loss_scale, fn_args=fn_args)
        elif points == "activations":
            value = gp(losses, [activations[layer] for layer in gp.config.layers],
                       loss_scale=loss_scale)
        else:
            chosen = list(params)
            if divided:  # of the window's gradient
                terms.task, value = accumulation._micro_batch(
                    name, gp, mean, mean_loss, state, chosen, last=bool(last), rows=rows,
                    retain_graph=retain, hand_over=not split)
                if value is None:  # not the last micro-batch: the penalty is still to come
                    continue
            elif gp.needs_callable and terms.task is mean:  # two passes, the task's gradient
                terms.task, value = penalized_loss(gp, LossAt(mean_loss, mean, state), chosen,
                                                   retain_graph=retain, split=split)
            else:
                at = LossAt(mean_loss, mean, state) if gp.needs_callable else mean
                value = gp(at, chosen, loss_scale=loss_scale)
        if gp.config.reduction == "sum" and gp.config.per_sample and size > 1:
            value = value * size  # a sum over the window, as a mean is the mean over it
        terms.penalties[name] = value
    return terms


def _per_sample_loss(model: Callable[[Tensor], Tensor],
                     loss: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``(x, *targets) -> loss(model(x), *targets)``: the per-sample losses as a function of the
    inputs, for a penalty of them that runs the model again."""

    def per_sample(x: Tensor, *targets: Tensor) -> Tensor:
        return loss(model(x), *targets)

    return per_sample
