"""What a penalty refuses before computing anything: batches it cannot penalize per sample.

A per-sample penalty needs the outputs of each sample, ``[B]`` or ``[B, ...]`` for ``B`` points:
the gradient of a batch *mean* w.r.t. sample :math:`x_i` is :math:`\\frac1B \\nabla f(x_i)`, so a
squared-norm penalty of it is :math:`B^2` times too small, and a target of 1 (WGAN-GP) pulls the
wrong norm; the gradient of a batch *sum* is each sample's own only where the samples do not
interact, which a scalar does not let the penalty check. A penalty of per-sample *losses*
(``of="loss"``: double backprop, ``intermediate``) needs one loss per sample, ``[B]``: given
logits ``[B, C]`` it would penalize the gradient of the summed logits, not of the loss. Nothing in
the numbers shows either; only the shapes do.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor

from gradreg.autograd import GradientError

__all__ = ["check_outputs", "check_points", "model_without_in_place_updates"]


@contextmanager
def model_without_in_place_updates(what: str) -> Iterator[None]:
    """Run a ``torch.func`` transform (``jvp``, ``vjp``) of a model, with torch's error for an
    op that updates a tensor of the model in place (BatchNorm in training mode updating its
    running statistics) turned into a :class:`~gradreg.GradientError` naming ``what`` and the
    fix."""
    try:
        yield
    except RuntimeError as err:
        if "mutate a captured Tensor" not in str(err):
            raise
        raise GradientError(
            f"{what} runs the model under torch.func, which cannot run an op that updates a "
            "tensor of the model in place, such as BatchNorm in training mode updating its "
            "running statistics (whose outputs would also couple the samples). Put "
            "normalization layers in eval mode, or use a per-sample normalization (GroupNorm, "
            f"LayerNorm). Torch said: {err}"
        ) from err


def check_points(inputs: tuple[Tensor, ...], *, per_sample: bool = True) -> None:
    """Raise :class:`~gradreg.GradientError` for points a penalty would silently get wrong: the
    same tensor twice (its gradient would be counted twice: the penalty of ``[a, a]`` is that
    of ``a`` with the gradient doubled), complex points (the "penalty" would be complex), and,
    per sample, points of different batch sizes (torch would broadcast a batch of one against
    the others)."""
    if not inputs:
        raise GradientError("no points given: pass the tensor(s) to differentiate against.")
    sizes, seen = [], {}
    for i, x in enumerate(inputs):
        if not isinstance(x, Tensor):
            raise GradientError(f"point {i} is a {type(x).__name__}, not a tensor: pass the "
                                "tensor(s) the outputs were computed from.")
        if x.is_complex():
            raise GradientError(
                f"point {i} is complex ({x.dtype}): a gradient penalty is defined for real "
                "points. Pass the real and imaginary parts as two real points "
                "(torch.view_as_real(x)) before the forward pass.")
        j = seen.setdefault(id(x), i)
        if j != i:
            raise GradientError(
                f"points {j} and {i} are the same tensor: its gradient would be counted "
                "twice. Pass each point once.")
        sizes.append(x.shape[0] if x.ndim > 0 else 1)
    if per_sample and len(set(sizes)) > 1:
        raise GradientError(
            f"the points have batch sizes {sizes}: every point of a per-sample penalty is one "
            "row per sample of the same batch (a batch of 1 would be broadcast against the "
            "others, mixing samples). Pass points of the same batch size.")


def check_outputs(outputs: Tensor, inputs: tuple[Tensor, ...], *, per_sample: bool = True,
                  losses: bool = False) -> None:
    """Raise :class:`~gradreg.GradientError` for outputs a penalty would silently get wrong:
    complex outputs; with ``per_sample``, an empty batch, or outputs that are not one row per
    sample of the points ``inputs`` (a scalar such as ``D(x).mean()``, or another batch size);
    with ``losses`` (a penalty of per-sample losses, ``of="loss"``), more than one value per
    sample, such as logits ``[B, C]`` (the penalty would differentiate their sum over the
    classes, not the loss). The one check of the outputs of a penalty call, run once per call
    (:attr:`~gradreg.penalties.call.PenaltyCall.check`)."""
    if outputs.is_complex():
        raise GradientError(
            f"the outputs are complex ({outputs.dtype}): a penalty differentiates real "
            "per-sample values. Penalize a real function of them (outputs.abs(), or "
            "torch.view_as_real(outputs)).")
    if not per_sample:
        return
    batch = inputs[0].shape[0] if inputs[0].ndim > 0 else 1
    if batch == 0 or (outputs.ndim > 0 and outputs.shape[0] == 0):
        raise GradientError(
            "empty batch: there are no samples to penalize. Skip the penalty for empty "
            "batches (or use drop_last=True in the data loader)."
        )
    if outputs.ndim > 0 and outputs.shape[0] not in (batch, 1):
        raise GradientError(
            f"the outputs have shape {tuple(outputs.shape)}, but the points are a batch of "
            f"{batch} samples: pass the outputs computed from these points, one row per sample "
            f"([{batch}] or [{batch}, ...])."
        )
    if batch > 1 and outputs.ndim == 0:
        raise GradientError(
            f"the outputs are a scalar, but the points are a batch of {batch} samples: pass the "
            f"per-sample outputs, one row per sample ([{batch}] or [{batch}, ...]), e.g. D(x) "
            "rather than D(x).mean() or D(x).sum(), and per-sample losses "
            "(F.cross_entropy(..., reduction='none')) rather than their mean or sum. The "
            f"gradient of a batch mean is 1/{batch} of each sample's, so the penalty would be "
            f"{batch}² times too small; that of a batch sum is each sample's own only where the "
            "samples do not interact, which the penalty checks on per-sample outputs only."
        )
    if batch > 1 and outputs.shape[0] != batch:
        raise GradientError(
            f"the outputs have shape {tuple(outputs.shape)}, but the points are a batch of "
            f"{batch} samples: pass the per-sample outputs, one row per sample ([{batch}] or "
            f"[{batch}, ...]), e.g. D(x) rather than D(x).mean()."
        )
    if losses and outputs.ndim > 1 and outputs[0].numel() > 1:
        raise GradientError(
            f"the outputs have shape {tuple(outputs.shape)}, but this penalty is of per-sample "
            f"losses (of='loss'), one per sample ([{outputs.shape[0]}]): given logits or other "
            "outputs it would penalize the gradient of their sum, not of the loss. Pass the "
            "per-sample losses, e.g. F.cross_entropy(logits, labels, reduction='none'), or "
            "reduce a loss per sample first (losses.flatten(1).mean(1))."
        )
