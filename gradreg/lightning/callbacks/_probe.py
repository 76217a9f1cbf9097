r"""Differentiating the model outside its training step: per-sample input gradients.

Used by the monitor (statistics of :math:`\lVert\nabla_{x_i}\ell_i\rVert`) and by the saliency maps
(:math:`\lvert\nabla_{x_i}\ell_i\rvert` as an image), so both show the same quantity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradreg import gradient
from gradreg.penalties import as_points

LossFn = Callable[[Tensor, Tensor], Tensor]


def cross_entropy_per_sample(outputs: Tensor, targets: Tensor) -> Tensor:
    r""":math:`\ell_i = -\log \operatorname{softmax}(f(x_i))_{y_i}`, one value per sample."""
    return F.cross_entropy(outputs, targets, reduction="none")


def split_batch(batch: Any, who: str) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)``: the first two entries of a tuple/list batch."""
    if (
        isinstance(batch, (tuple, list))
        and len(batch) >= 2
        and all(isinstance(t, Tensor) for t in batch[:2])
    ):
        return batch[0], batch[1]
    raise ValueError(
        f"{who} differentiates a loss of (inputs, targets) batches, but got a batch of type "
        f"{type(batch).__name__}. Pass loss_fn=None to turn input gradients off for modules "
        "whose batches are not (inputs, targets) pairs."
    )


@contextmanager
def eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Put ``modules`` in eval mode inside the block and restore each one's mode after it."""
    modes = [module.training for module in modules]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module, mode in zip(modules, modes, strict=True):
            module.train(mode)


def input_gradients(model: nn.Module, inputs: Tensor, targets: Tensor, loss_fn: LossFn) -> Tensor:
    r""":math:`\nabla_{x_i}\ell(f(x_i), y_i)` for every sample, shaped like ``inputs``.

    The gradient of :math:`\sum_i \ell_i` with ``model`` in eval mode (dropout off, batch-norm
    statistics fixed), so samples do not interact and row :math:`i` is exactly the per-sample
    gradient. ``loss_fn(outputs, targets)`` must return per-sample losses, shape ``[B]``. No
    ``.grad`` attribute is touched; the inputs are copied first, so tensors made under
    ``torch.inference_mode`` (a validation batch) work too.
    """
    with torch.enable_grad(), eval_mode(model):
        x = as_points(inputs.clone())
        losses = loss_fn(model(x), targets.clone())
        if losses.shape != (x.shape[0],):
            raise ValueError(
                f"loss_fn must return one loss per sample, shape [{x.shape[0]}], but returned "
                f"shape {list(losses.shape)}. Use reduction='none' in the loss."
            )
        return gradient(losses.sum(), x, create_graph=False)


def module_attribute(pl_module: nn.Module, name: str, role: str, kind: type, who: str) -> Any:
    """``pl_module.<name>``, which must be the ``role`` (an instance of ``kind``); else an error
    that says how to name the attribute (``who(role='...')``)."""
    value = getattr(pl_module, name, None)
    if not isinstance(value, kind):
        raise ValueError(
            f"{who} needs pl_module.{name} to be the {role} ({kind.__name__}), "
            f"but {type(pl_module).__name__}.{name} is {type(value).__name__}; name the "
            f"attribute with {who}({role}='...')."
        )
    return value


def real_samples(batch: Any) -> Tensor:
    """The real samples of a GAN's batch: the batch itself, or its first entry."""
    return (batch if isinstance(batch, Tensor) else batch[0]).detach()
