r"""A parameter-gradient penalty of an accumulated batch: two phases over the micro-batches.

With a batch split into :math:`N` micro-batches of :math:`n_k` samples and :math:`L_k` the mean
loss of micro-batch :math:`k`, the big batch's mean loss is :math:`L = \sum_k w_k L_k` and its
gradient :math:`\bar g = \sum_k w_k g_k`, :math:`w_k = n_k / \sum_j n_j` (:math:`\frac1N` for
micro-batches of equal size). Penalizing :math:`P(\bar g)` (``param_grad_norm``:
:math:`\lVert \bar g\rVert`) is not a sum over micro-batches, :math:`P(\bar g) \ne \frac1N \sum_k
P(g_k)`: penalizing each micro-batch's own gradient (what one backward per micro-batch of
``loss + penalty`` does) is another objective. Its gradient is

.. math::

    \nabla_\theta P(\bar g) = \bar H v, \qquad v = \partial P/\partial \bar g, \qquad
    \bar H v = \tfrac1N \textstyle\sum_k H_k v,

a sum over micro-batches of Hessian-vector products along *one* direction that depends on all of
them. :func:`accumulated_backward` therefore runs two phases: the first takes :math:`g_k` of
each micro-batch (a forward and a backward each, the graph freed) and sums :math:`\bar g`; the
second, with :math:`v` known, takes :math:`H_k v` of each micro-batch, by a forward and backward
at :math:`\theta + h\hat v` (``method="finite_difference"``: :math:`\bar H v \approx \lVert v
\rVert (\bar g' - \bar g)/h`, :math:`\bar g'` the mean gradient there, :math:`h` by the
``shift`` rule of :mod:`~gradreg.penalties.methods.param_gradient`) or by a forward and a
double backward at :math:`\theta` (``"double_backward"``, exact). Each micro-batch's second
forward draws the random numbers of its first (dropout's masks) and leaves the modules' buffers
as the first left them (BatchNorm counts each micro-batch once). The cost is that of the
unaccumulated step per micro-batch; memory that of one micro-batch. The result equals the one
big batch's step within float rounding (for models whose samples do not interact: BatchNorm in
training mode normalizes per micro-batch, as any accumulation does).

The plain-loop form::

    optimizer.zero_grad()
    accumulated_backward(gnp, [partial(loss_fn, xb, yb) for xb, yb in micro_batches],
                         params, rows=[len(yb) for _, yb in micro_batches], on=(x,))
    optimizer.step()

A training loop that hands over one micro-batch per backward (Lightning's automatic optimization
with ``accumulate_grad_batches``) uses :class:`Accumulation`: each micro-batch's backward carries
its :math:`g_k`, and the last one's also the penalty's gradient, after the second phase over the
micro-batches kept until then (the Lightning ``Classifier`` does so).

A batch split over the :math:`W` ranks of ``torch.distributed``'s default group (DDP, equal
shares) is split the same way: its gradient is the mean over the ranks of their (accumulated)
gradients, :math:`\bar g = \frac1W \sum_r \bar g_r`, and :math:`\bar H v = \frac1W \sum_r
\bar H_r v`. With ``over_ranks`` the first phase ends with one all-reduce of :math:`\bar g_r`
(the penalty's value and :math:`v` are then the whole batch's, the same on every rank) and each
rank's second phase gives its :math:`\bar H_r v`, which DDP's mean of the ranks' gradients
completes (:func:`accumulated_backward`, for a model not wrapped in DDP, averages the step's
gradient itself: a second all-reduce). Without it each rank penalizes its own gradient, another
objective, as for micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from gradreg.autograd import GradientError
from gradreg.penalties.formulas.norms import per_sample_norm
from gradreg.penalties.guards.precision import unit_roundoff
from gradreg.penalties.mechanism import GradientPenalty
from gradreg.penalties.methods.param_gradient import (
    _gradient,
    _gradient_and_unused,
    _shifted_gradient,
    adaptive_norm_terms,
    check_default_step_is_smooth,
    difference_quotient,
    in_dtypes,
    parameter_step,
    shift_length,
    shifted_parameters,
    trainable,
    without_unused,
)
from gradreg.penalties.state.buffers import KeptBuffers
from gradreg.penalties.state.randomness import GeneratorState
from gradreg.penalties.two_pass import add_to_grad

__all__ = ["Accumulation", "accumulated_backward", "agreed_over_ranks", "combined",
           "mean_over_ranks"]

WHAT = "accumulated_backward"
#: how the finite difference shifts the parameters: ``shift(params, vectors, amounts)``, a
#: context in which they are :math:`\theta_j + a_j d_j` (:func:`shifted_parameters`; a
#: partitioned engine's own, :mod:`gradreg.integrations.engine_penalty`)
Shift = Callable[[Sequence[Tensor], Sequence[Tensor], list[Tensor]], AbstractContextManager]


def _mean(parts: Iterator[list[Tensor]], rows: list[int] | None, count: int) -> list[Tensor]:
    """The mean of ``count`` lists of tensors, weighted by ``rows`` (the samples of each: the
    mean over the samples of all) where given, summed one list at a time (one list's memory)."""
    weights = iter(rows or ())
    total = next(parts)
    if rows is not None:
        torch._foreach_mul_(total, float(next(weights)))
    for part in parts:
        alpha = 1.0 if rows is None else float(next(weights))
        for t, u in zip(total, part, strict=True):
            t.add_(u, alpha=alpha)
    return [t.div_(count if rows is None else sum(rows)) for t in total]


class Accumulation:
    r"""The two phases (module docstring) for micro-batches handed over one at a time:
    :meth:`add` runs a micro-batch's first phase, :meth:`finish` the second phase of all of
    them. ``penalty``: on ``points="parameters"`` by ``"finite_difference"`` or
    ``"double_backward"``, weighted as it is (:math:`c`: its weight times ``every`` and
    ``gain``); ``over_ranks``: the micro-batches are this rank's share of a batch split over the
    ranks (module docstring); ``shift``: how the finite difference shifts the parameters
    (:data:`Shift`)."""

    def __init__(self, penalty: GradientPenalty, params: Sequence[Tensor], *,
                 over_ranks: bool = False, shift: Shift = shifted_parameters) -> None:
        config = penalty.config
        if config.points != "parameters" or config.method.name not in ("finite_difference",
                                                                    "double_backward"):
            raise GradientError(
                f"{WHAT} takes a penalty on points='parameters' by method='finite_difference' "
                f"or 'double_backward', got points={config.points!r}, "
                f"method={config.method.name!r}.")
        if over_ranks and not (torch.distributed.is_available()
                               and torch.distributed.is_initialized()):
            raise GradientError(
                f"{WHAT} with over_ranks=True averages the gradient over the ranks of "
                "torch.distributed's default group, and none is initialized: call "
                "torch.distributed.init_process_group first (torchrun, or Lightning's DDP), or "
                "leave over_ranks=False in one process.")
        self.penalty, self.params = penalty, trainable(list(params), WHAT)
        self.over_ranks, self.shift = over_ranks, shift
        #: this rank's share N_r / N of the samples, set by finish() over ranks with rows given
        self.share: Tensor | None = None
        # whether the first window's checks ran: the default step on a smooth loss, a shifted
        # forward watched for draws no captured state replays
        self._checked = False
        self._buffers = KeptBuffers(WHAT)
        self._reset()

    def _reset(self) -> None:
        self._stored: list[tuple[Callable[[], Tensor], GeneratorState]] = []
        self._rows: list[int | None] = []
        self._sum: list[Tensor] | None = None
        self._roundoff = 0.0
        self._unused: frozenset[int] = frozenset()  # by every micro-batch added so far

    def add(self, fn: Callable[[], Tensor], state: GeneratorState, loss: Tensor | None = None,
            *, rows: int | None = None, retain_graph: bool = False) -> list[Tensor | None]:
        r"""The first phase of one micro-batch: the gradient :math:`g_k` of its loss ``loss``
        (computed by ``fn()`` from ``state`` where not given), returned (None for a parameter
        the loss does not use, as a backward leaves its ``.grad``) and summed, weighted by
        ``rows`` (the number of samples its mean loss is over) where given: the mean gradient is
        then that of all the samples, :math:`\bar g = \sum_k n_k g_k / \sum_k n_k`, and else
        the micro-batches' mean, :math:`\frac1N \sum_k g_k` (equal sizes). ``fn`` and ``state``
        (the random state its forward began with) are kept for :meth:`finish`."""
        if self._rows and (rows is None) != (self._rows[0] is None):
            raise GradientError(f"{WHAT}: rows given for some micro-batches and not for others: "
                                "give each micro-batch's number of samples, or none.")
        if loss is None:
            with state.replayed():
                loss = fn()
        config = self.penalty.config
        if not (self._stored or self._checked) and config.method.name == "finite_difference":
            check_default_step_is_smooth(loss, config.step, config.shift, config.adaptive)
        g, unused = _gradient_and_unused(loss, self.params, retain=retain_graph)
        if self.over_ranks:  # a parameter unused here may be used on another rank
            unused = frozenset()
        self._unused = unused if not self._stored else self._unused & unused
        self._stored.append((fn, state))
        self._rows.append(rows)
        self._roundoff = max(self._roundoff, unit_roundoff(loss))
        weight = 1.0 if rows is None else float(rows)
        if self._sum is None:
            self._sum = [t * weight for t in g]
        else:
            for total, t in zip(self._sum, g, strict=True):
                total.add_(t, alpha=weight)
        return without_unused(g, unused)

    def finish(self) -> tuple[Tensor, list[Tensor | None]]:
        r"""The weighted penalty :math:`c\,P(\bar g)` (detached) of the mean gradient of the
        micro-batches added since the last call, and its parameter gradient :math:`c\,\bar H
        v`, by the second phase over them (their forwards replayed from their states); None for
        a parameter that no micro-batch's loss uses."""
        if self._sum is None:
            raise GradientError(f"{WHAT}: no micro-batch was added before finish().")
        penalty, params, config = self.penalty, self.params, self.penalty.config
        stored, count = self._stored, len(self._stored)
        rows = None if self._rows[0] is None else [int(n) for n in self._rows]
        total = count if rows is None else sum(rows)
        if self.over_ranks:  # before the gradients' all-reduce, which would mismatch
            agreed_over_ranks({"penalized parameters' entries": sum(t.numel() for t in self._sum),
                               "rows given": int(rows is not None)}, f"{WHAT} over ranks")
        if self.over_ranks and rows is not None:  # Σ_r N_r ḡ_r / Σ_r N_r
            self.share = mean_over_ranks(self._sum, total)
            g = self._sum
        else:
            g = [t.div_(total) for t in self._sum]
            if self.over_ranks:
                mean_over_ranks(g)
        roundoff, unused = self._roundoff, self._unused
        self._reset()
        leaves = [t.detach().requires_grad_() for t in g]
        factor = penalty.factor
        with torch.enable_grad():
            terms = adaptive_norm_terms(leaves, params) if config.adaptive else leaves
            value = penalty._of_norms(per_sample_norm(terms, config.p, squared=config.squared,
                                                      per_sample=False))
            v = torch.autograd.grad(value, leaves)
        penalty.last_value = value.detach()
        weighted = value.detach() * factor
        if config.check_finite:  # as the penalty's own call checks its value
            penalty.finite_check(penalty.last_value, weighted=weighted, factor=factor)
        if config.method.name == "double_backward":  # H_k v exactly, by double backward
            return weighted, without_unused(_mean(
                (_hessian_vector(fn, state, params, [factor * d for d in v], self._buffers)
                 for fn, state in stored), rows, count), unused)
        length = torch.sqrt(sum(d.square().sum() for d in v))  # the mean gradient at θ + h v̂
        step = parameter_step(config.step, config.shift, roundoff)
        shift, scale = shift_length(config.shift, step, length, config.gain)
        along = torch.where(length > 0, shift / torch.where(length > 0, length, 1.0), 0.0)
        with self.shift(params, v, in_dtypes(along, v)):
            shifted = _mean((_shifted_gradient(fn, state, True, params, self._buffers,
                                               watch=not self._checked and k == 0)
                             for k, (fn, state) in enumerate(stored)), rows, count)
        self._checked = True
        return weighted, without_unused(difference_quotient(shifted, g, scale * factor), unused)


def accumulated_backward(penalty: GradientPenalty, losses: Sequence[Callable[[], Tensor]],
                         params: Sequence[Tensor], *, rows: Sequence[int] | None = None,
                         on: Sequence[Tensor] = (), over_ranks: bool = False
                         ) -> tuple[Tensor, Tensor]:
    r"""Add to each parameter's ``.grad`` the gradient of :math:`L + c\,P(\bar g)` of the
    accumulated batch (module docstring); ``losses``: one callable per micro-batch returning its
    mean loss; ``rows``: the number of samples of each micro-batch, :math:`n_k` (required for
    more than one micro-batch, or with ``over_ranks``: the batch's mean loss is :math:`L =
    \sum_k n_k L_k / \sum_k n_k`, a last micro-batch of fewer samples weighted as one batch
    weights its samples); ``penalty``: as for :class:`Accumulation` (call it only on steps where
    ``penalty.due()``); ``on``: the batch's tensors, whose devices' random states are replayed.
    The gradient reaches ``.grad`` as :func:`~gradreg.penalties.two_pass.add_to_grad` adds it
    (in a model wrapped in DDP, through DDP's reducer, which averages the ranks' steps). With
    ``over_ranks`` the micro-batches are this rank's share of a batch split over the ranks of
    ``torch.distributed``'s default group (shares of any sizes, weighted by their samples): the
    penalty is the whole batch's, and the gradient added is the whole batch's step gradient, the
    same on every rank (reduced here, so that a model not wrapped in DDP needs no reducer).
    Returns the detached mean loss and weighted penalty (this rank's mean loss).

    Examples:
        Micro-batches of two and six: the penalty is that of the batch of eight's gradient.

        >>> import torch
        >>> from gradreg.penalties import accumulated_backward, param_grad_norm
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Linear(3, 1).double()
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
        >>> params = list(model.parameters())
        >>> def loss(rows=slice(None)):
        ...     return torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        >>> norm = torch.cat([g.flatten() for g in torch.autograd.grad(loss(), params)]).norm()
        >>> gp = param_grad_norm(0.1, method="finite_difference")
        >>> parts = [lambda: loss(slice(0, 2)), lambda: loss(slice(2, 8))]
        >>> task, penalty = accumulated_backward(gp, parts, params, rows=[2, 6], on=(x,))
        >>> round(task.item(), 4), round(penalty.item(), 6) == round(0.1 * norm.item(), 6)
        (0.7568, True)
        >>> all(p.grad is not None for p in params)
        True
    """
    accumulation = Accumulation(penalty, params, over_ranks=over_ranks)
    if not losses:
        raise GradientError(f"{WHAT} needs at least one micro-batch's loss.")
    if rows is None and (len(losses) > 1 or over_ranks):
        raise GradientError(
            f"{WHAT} of {len(losses)} micro-batch(es){' over ranks' if over_ranks else ''} needs "
            "rows=[...], the number of samples each micro-batch's mean loss is over: the batch's "
            "mean loss weights each micro-batch by its samples (micro-batches of 4 and 12 are "
            "not halves).")
    if rows is not None and (len(rows) != len(losses) or any(n <= 0 for n in rows)):
        raise GradientError(f"{WHAT}: rows={list(rows)} must give a positive number of samples "
                            f"for each of the {len(losses)} micro-batches.")
    penalty._check_due()
    weights = [1.0] * len(losses) if rows is None else [n / sum(rows) for n in rows]
    values, task = [], None
    for fn, n, weight in zip(losses, rows or [None] * len(losses), weights, strict=True):
        state = GeneratorState.capture(*on, *accumulation.params)  # the first phase: the
        loss = fn()  # graphs freed one by one
        if not loss.requires_grad:
            raise GradientError(
                f"{WHAT}: micro-batch {len(values)}'s loss does not require grad (computed under "
                "torch.no_grad() or inference_mode, or of frozen parameters): compute it with "
                "grad enabled, from the parameters given.")
        values.append(loss.detach() * weight)
        part = [None if t is None else t.mul_(weight)
                for t in accumulation.add(fn, state, loss, rows=n)]
        task = part if task is None else combined(task, part)
    value, hv = accumulation.finish()
    task = combined(task, hv)
    if over_ranks:  # Σ_r N_r/N (the rank's step gradient), as DDP's backward would take it
        given = [t for t in task if t is not None]
        share = accumulation.share * torch.distributed.get_world_size()
        torch._foreach_mul_(given, in_dtypes(share.to(given[0].device), given))
        mean_over_ranks(given)
    add_to_grad(accumulation.params, task)  # through DDP's reducer where the model has one
    return torch.stack(values).sum(), value


def _add(total: Tensor | None, part: Tensor | None, alpha: float = 1.0) -> Tensor | None:
    """``total + alpha * part`` in ``total``'s memory (in ``part``'s where ``total`` is None),
    None standing for a gradient no loss gave (a parameter unused): None where both are."""
    if part is None:
        return total
    if total is None:
        return part if alpha == 1.0 else part.mul_(alpha)
    return total.add_(part, alpha=alpha)


def combined(gradients: Sequence[Tensor | None], penalty_gradients: Sequence[Tensor | None],
             alpha: float = 1.0) -> list[Tensor | None]:
    r"""``gradients + alpha * penalty_gradients`` per parameter, in their memory: a micro-batch's
    :math:`g_k` (:meth:`Accumulation.add`) and :math:`\bar H v` (:meth:`Accumulation.finish`),
    None for a parameter that neither reaches (it keeps ``.grad`` None)."""
    return [_add(g, h, alpha) for g, h in zip(gradients, penalty_gradients, strict=True)]


def mean_over_ranks(tensors: list[Tensor], rows: int | None = None) -> Tensor | None:
    r"""Replace ``tensors`` in place by their mean over the ranks of ``torch.distributed``'s
    default group, :math:`\frac1W \sum_r t_r` (one all-reduce of a flat copy per dtype); with
    ``rows`` (this rank's number of samples, :math:`N_r`; ``tensors`` then sums over them),
    :math:`\sum_r t_r / \sum_r N_r`, the mean over all the ranks' samples, and return this
    rank's share :math:`N_r / \sum_r N_r` (a 0-dim float64 tensor: one all-reduce more)."""
    world = torch.distributed.get_world_size()
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    share = None
    if rows is not None:
        device = tensors[0].device if tensors else torch.device("cpu")
        everyone = torch.tensor(float(rows), dtype=torch.float64, device=device)
        torch.distributed.all_reduce(everyone)
        share = rows / everyone
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        torch.distributed.all_reduce(flat)
        flat.div_(world) if share is None else flat.mul_((1 / everyone).to(flat.dtype))
        parts = flat.split([t.numel() for t in group])
        torch._foreach_copy_(group, [part.view_as(t) for part, t in zip(parts, group, strict=True)])
    return share


def agreed_over_ranks(facts: Mapping[str, int], what: str) -> None:
    """Raise the same :class:`~gradreg.autograd.GradientError` on every rank of
    ``torch.distributed``'s default group where the ranks' ``facts`` (name -> integer: whether a
    penalty is due, how many entries a gradient has) differ, naming each rank's value; by one
    all-gather of the integers, on the device of the default group's backend. Called by every
    rank before a collective whose shapes or presence depend on them, so that a disagreement is
    refused in one line instead of a collective mismatch (a hang, or the backend's abort)."""
    names = list(facts)
    device = torch.device("cuda", torch.cuda.current_device()) \
        if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([int(facts[name]) for name in names], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, mine)
    table = torch.stack(everyone).cpu().tolist()
    differing = [k for k, name in enumerate(names) if len({row[k] for row in table}) > 1]
    if differing:
        detail = "; ".join(f"{names[k]}: " + ", ".join(f"rank {r} {row[k]}"
                                                       for r, row in enumerate(table))
                           for k in differing)
        raise GradientError(
            f"{what}: the ranks disagree ({detail}), and each rank's step needs the others' "
            "in the same collective: build the penalties and the parameters alike on every "
            "rank, call penalty.due() once per step on each, and take the penalty on all of "
            "them or none.")


def _hessian_vector(fn: Callable[[], Tensor], state: GeneratorState, params: tuple[Tensor, ...],
                    v: list[Tensor], buffers: KeptBuffers) -> list[Tensor]:
    """:math:`H v` of one micro-batch's loss at the parameters, its forward run again with the
    random numbers and leaving the buffers of its first."""
    with buffers.kept(params):
        with state.replayed():
            loss = fn()
        g = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        dot = sum((a * b).sum() for a, b in zip(g, v, strict=True) if a is not None)
        if not isinstance(dot, Tensor) or not dot.requires_grad:
            return [torch.zeros_like(p) for p in params]
        return _gradient(dot, params, retain=False)
