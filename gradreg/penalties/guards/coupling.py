r"""Whether a model's samples interact, decided by what the model does, not by its layer types.

A penalty that runs the model on part of the batch (``subsample``, ``chunks``) or at points moved
by a different step per sample (finite differences, the perturbation estimate, the Hessian
penalty, the spectral norm's per-sample Jacobian-vector products) is the per-sample penalty only
when each sample's outputs depend on that sample's inputs alone. Layers that couple the samples
(BatchNorm in training mode, StyleGAN2's minibatch standard deviation, attention across the
batch) make these penalties silently different from the one of the batch's forward.

The probe: one backward of :math:`\sum_{i \ne 0} \langle w_i, f_i \rangle` (fixed weights
:math:`w_i` drawn from a generator of its own, :math:`w_0 = 0`) to the points. For samples that
do not interact the rows of sample 0 of that gradient are exactly zero (every product that
reaches them carries a zero); a nonzero entry there proves that another sample's outputs depend
on sample 0's input. It needs two samples in the forward it probes, a first-order backward, and
costs one backward of the batch where the penalty's own graph is at hand (one forward more where
it is not: :func:`probe_independent_samples`, under the replayed random state, so the generators
do not move, and with a module's buffers restored after it); the methods run it on their first
call only. A coupling that does not pass through
the graph (a batch statistic computed under ``no_grad`` or detached) is not seen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from gradreg.autograd import GradientError
from gradreg.graph import walk_backward_graph
from gradreg.penalties.state.randomness import GeneratorState, SharedForward
from gradreg.torch_compat import batchnorm_node_in_training

__all__ = ["check_independent_samples", "probe_independent_samples"]


def check_independent_samples(outputs: Tensor | Sequence[Tensor], points: Sequence[Tensor],
                              what: str, *, retain_graph: bool = True) -> None:
    """Raise :class:`~gradreg.GradientError` where the outputs of samples 1.. depend on sample
    0's ``points`` (module docstring). ``outputs``: the per-sample outputs (a tensor, or several
    as a list), batch first, with their graph to ``points``; a batch of one is not probed.
    ``retain_graph``: keep that graph for a later backward (False: the graph is the probe's)."""
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    outputs = [o for o in outputs if o.requires_grad and o.ndim > 0 and o.shape[0] > 1]
    wanted = [x for x in points if x.requires_grad and x.ndim > 0 and x.shape[0] > 1]
    if not outputs or not wanted:
        return
    weights = []
    for o in outputs:
        draw = torch.Generator(device=o.device).manual_seed(0)
        w = torch.rand(o.shape, generator=draw, device=o.device, dtype=o.dtype) + 0.5
        w[0] = 0
        weights.append(w)
    grads = torch.autograd.grad(outputs, wanted, grad_outputs=weights,
                                retain_graph=retain_graph,
                                allow_unused=True)
    if any(g is not None and bool(((g[0] != 0) & g[0].isfinite()).any()) for g in grads):
        raise GradientError(_coupled_message(what, outputs))


def probe_independent_samples(fn: Callable[..., Tensor | Sequence[Tensor]],
                              points: Sequence[Tensor], what: str,
                              args: Sequence[Tensor] = ()) -> None:
    """:func:`check_independent_samples` of ``fn(*points, *args)`` run once more at detached
    copies of the points, from the current random state, which it leaves unchanged. Where
    ``fn`` is a module or a method of one (or a :class:`~gradreg.penalties.state.randomness
    .SharedForward` of one), the buffers that forward changed are restored
    (BatchNorm's running statistics and ``num_batches_tracked``, spectral normalization's
    vectors)."""
    leaves = tuple(x.detach().requires_grad_() for x in points)
    run = fn.fn if isinstance(fn, SharedForward) else fn
    owner = run if isinstance(run, nn.Module) else getattr(run, "__self__", None)
    buffers = list(owner.buffers()) if isinstance(owner, nn.Module) else []
    saved = [b.clone() for b in buffers]
    try:
        with torch.enable_grad(), GeneratorState.capture(*points).replayed():
            outputs = fn(*leaves, *args)
        check_independent_samples(outputs, leaves, what, retain_graph=False)
    finally:  # only those that changed: the others may be saved for the caller's backward
        with torch.no_grad():
            for buffer, value in zip(buffers, saved, strict=True):
                if not torch.equal(buffer, value):
                    buffer.copy_(value)


def _coupled_message(what: str, outputs: list[Tensor]) -> str:
    batchnorm = sorted({name for node in walk_backward_graph(outputs).nodes
                        if "BatchNorm" in (name := type(node).__name__)
                        and "BackwardBackward" not in name  # forward nodes say the mode
                        and batchnorm_node_in_training(node)})
    named = (f" (its graph holds BatchNorm in training mode ({', '.join(batchnorm)}), which "
             "normalizes by the batch's statistics and updates its running statistics at every "
             "forward)" if batchnorm else "")
    return (
        f"{what} runs the model on part of the batch or at points moved per sample, but the "
        f"model's samples are coupled: the outputs of the others depend on sample 0's input"
        f"{named}. The penalty would differ from that of the batch's own forward. Put "
        "normalization layers in eval mode, or use a per-sample normalization (GroupNorm, "
        "LayerNorm) and no layer that mixes samples (a minibatch standard deviation); for a "
        "gradient-norm penalty, the exact one on the task's forward (method='double_backward', "
        "subsample=1, chunks=1) is unaffected.")
