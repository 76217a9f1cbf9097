"""The cost levers that keep the exact gradient or its expectation: the penalty in micro-batches
(:func:`in_chunks`) and on a subsample (:func:`subsample`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from gradreg.attention import differentiable_attention
from gradreg.autograd import GradientError
from gradreg.graph import graph_leaves
from gradreg.penalties.call import PenaltyCall, PenaltyFunctions
from gradreg.penalties.guards.compiled import check_not_compiled
from gradreg.penalties.methods.surrogate import with_gradients
from gradreg.penalties.state.loss_scale import unscaled
from gradreg.penalties.state.randomness import GeneratorState

__all__ = ["InChunks", "in_chunks", "subsample"]

PenaltyOfPoints = Callable[[tuple[Tensor, ...], tuple[Tensor, ...]], Tensor]


def in_chunks(
    penalty_of_points: PenaltyOfPoints,
    inputs: tuple[Tensor, ...],
    chunks: int,
    *,
    args: tuple[Tensor, ...] = (),
    mean: bool,
    loss_scale: float | Tensor | None = None,
) -> Tensor:
    r"""A per-sample penalty evaluated ``chunks`` micro-batches at a time; exact, less memory.

    For a penalty that is a mean (``mean=True``) or a sum of per-sample terms, split the batch of
    :math:`B` samples into micro-batches :math:`c` of :math:`B_c` samples:

    .. math::

        P = \sum_c w_c P_c, \quad w_c = B_c / B \text{ (mean) or } 1 \text{ (sum)}, \qquad
        \nabla_\theta P = \sum_c w_c \nabla_\theta P_c .

    Each :math:`P_c` = ``penalty_of_points(points_c, args_c)`` (its own forward at fresh leaves
    that are the micro-batch's points, with the micro-batch's rows of the per-sample ``args``
    such as labels, and its double-backward graph) is differentiated at once by
    ``torch.autograd.grad`` w.r.t. every leaf it depends on (the parameters) and, where the points
    come from upstream computation (a generator), w.r.t. the points; then its graph is freed. The
    sums of these exact gradients reach the caller's single ``backward`` through
    :func:`~gradreg.penalties.methods.surrogate.with_gradients`. So ``.grad`` is that of the
    unchunked penalty, to float rounding, while at most one micro-batch's double-backward graph
    is alive: the memory of the penalty's graph falls by about ``chunks``, for the price of up
    to two parameter-sized buffers (the
    running sum and one micro-batch's gradient). The products computed are those of the same
    penalty run unchunked on its own forward (WGAN-GP's interpolates), in smaller kernels; a
    penalty that could have shared the task's forward (R1 on the reals, double backprop) pays
    one more forward and backward. Samples must not interact (BatchNorm in training mode is
    refused); leaf points receive no gradient (as with :func:`gradreg.regularized_backward`).
    Nor may the model draw random numbers (dropout in training mode): a micro-batch's forward
    draws other numbers for its samples than the batch's forward would, so the sum would not be
    the penalty of any one forward (:class:`~gradreg.penalties.methods.chunks.InChunks` refuses it).
    Under a ``loss_scale`` (fp16) each micro-batch is differentiated scaled and unscaled after,
    like the penalty itself.
    """
    batch = inputs[0].shape[0]
    upstream = [x.grad_fn is not None for x in inputs]
    values: list[Tensor] = []
    leaf_grads: dict[int, tuple[Tensor, Tensor]] = {}
    point_grads: list[list[Tensor]] = [[] for _ in inputs]
    pieces = max(1, min(chunks, batch))  # an empty batch reaches the penalty's own error
    for part in zip(*(x.tensor_split(pieces) for x in inputs + args), strict=True):
        points = tuple(x.detach().requires_grad_() for x in part[:len(inputs)])
        value = penalty_of_points(points, part[len(inputs):]) * (
            len(points[0]) / batch if mean else 1.0)
        mine = {id(x) for x in points}
        leaves = [t for t in graph_leaves([value]) if id(t) not in mine]
        wanted = leaves + [x for x, up in zip(points, upstream, strict=True) if up]
        grads = unscaled(partial(torch.autograd.grad, inputs=wanted, allow_unused=True), value,
                         loss_scale)
        grads = [torch.zeros_like(t) if g is None else g
                 for t, g in zip(wanted, grads, strict=True)]
        for leaf, g in zip(leaves, grads[:len(leaves)], strict=True):
            if id(leaf) in leaf_grads:
                leaf_grads[id(leaf)][1].add_(g)  # in place: one buffer per leaf
            else:  # an expanded view (stride 0) cannot be added to in place
                leaf_grads[id(leaf)] = (leaf, g.contiguous())
        rest = iter(grads[len(leaves):])
        for collected, up in zip(point_grads, upstream, strict=True):
            if up:
                collected.append(next(rest))
        values.append(value.detach())
    tensors = [t for t, _ in leaf_grads.values()] + [x for x, up in zip(inputs, upstream,
                                                                        strict=True) if up]
    gradients = [g for _, g in leaf_grads.values()] + [torch.cat(c) for c in point_grads if c]
    return with_gradients(sum(values), tensors, gradients)


def subsample(inputs: tuple[Tensor, ...], fraction: float) -> tuple[Tensor, ...]:
    r"""The first :math:`k = \max(2, \lceil \text{fraction} \cdot B \rceil)` samples of every
    input (all of them for :math:`B \le 2`); at least two, so that a coupling of samples shows
    in the subsample's forward (:mod:`~gradreg.penalties.guards.coupling`).

    StyleGAN2's batch shrink. With a batch in random order the penalty of the subset is an
    unbiased estimate of the batch's for ``reduction="mean"`` (the caller rescales a sum by
    :math:`B/k`), with variance growing as :math:`1/k`; the cost of the penalty shrinks by about
    ``fraction``.
    """
    if fraction >= 1:
        return inputs
    k = max(2, math.ceil(fraction * inputs[0].shape[0]))
    return tuple(x[:k] for x in inputs)


class InChunks:
    """Exact, ``chunks`` micro-batches at a time
    (:func:`~gradreg.penalties.methods.chunks.in_chunks`). On the first call every micro-batch holds
    at least two samples (split into fewer pieces where the batch is small), so that the probe of
    coupled samples (:func:`~gradreg.penalties.guards.coupling.check_independent_samples`, run on
    the first
    micro-batch's graph) can see one sample's outputs move with another's input."""

    def __init__(self, penalty: PenaltyFunctions, chunks: int, *, mean: bool) -> None:
        self.penalty, self.chunks, self.mean = penalty, chunks, mean
        self._probed = False

    def __call__(self, call: PenaltyCall) -> Tensor:
        batch = call.inputs[0].shape[0] if call.inputs[0].ndim else 1
        chunks = self.chunks if self._probed else max(1, min(self.chunks, batch // 2))
        watch = chunks > 1  # the first micro-batch's forward, when there are several

        def penalty_of_points(xs: tuple[Tensor, ...], args: tuple[Tensor, ...]) -> Tensor:
            nonlocal watch
            state, watch = GeneratorState.capture(*xs) if watch else None, False
            with differentiable_attention():
                outputs = call.fn(*xs, *args)
            call.check(outputs, inputs=xs)
            check_not_compiled(outputs)
            if state is not None and state.moved():
                raise GradientError(
                    f"chunks={self.chunks} runs the model one micro-batch at a time, but the "
                    "model draws random numbers (dropout or another random layer in training "
                    "mode): a micro-batch's forward draws other masks for its samples than the "
                    "batch's forward, so the chunked penalty would not be that of one forward. "
                    "Put the random layers in eval mode for the penalty, or use chunks=1 (the "
                    "exact double backward of one forward).")
            return self.penalty.exact(outputs, xs, call.loss_scale)

        value = in_chunks(penalty_of_points, call.inputs, chunks, args=call.fn_args,
                          mean=self.mean, loss_scale=call.loss_scale)
        self._probed = True
        return value
