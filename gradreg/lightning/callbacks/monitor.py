r"""Watch what a penalty does to the gradients: losses, parameter, input and penalty values.

Every ``log_every_n_steps`` optimizer steps (or ``every_n_steps``) the monitor writes, in the tag
scheme of :mod:`gradreg.lightning.dashboards` (``<owner>``: the submodule that holds all of an
optimizer's parameters, ``critic`` or ``generator``, or ``optimizer_<i>`` where no one submodule
does; left out when there is one optimizer):

* ``loss/total[/<owner>]``: the loss backpropagated before the optimizer's step (what Lightning's
  backward got: the task loss plus the weighted penalties; the sum over the micro-batches of an
  accumulation window, which Lightning divides by their number);
* ``grad_norm/total[/<owner>]``: :math:`\lVert\partial L/\partial\theta\rVert_p` over the
  gradients the optimizer is about to apply;
* histograms ``param_grad/<layer>``: the gradient entries of each layer's weights (its parameters
  of two or more dimensions, one card per layer), and ``param_grad_bias/<layer>``: of its 1-D
  parameters (biases, a normalization's scale), in a group of their own, as their scale differs;
  about to be applied;
* ``penalty/unweighted/<path>``, ``penalty/weighted/<path>`` and ``penalty/weight/<path>``: of
  every :class:`~gradreg.penalties.GradientPenalty` submodule, ``last_value`` (the penalty of its
  last call; lazy penalties keep theirs), the term it added to the loss there
  (:math:`\lambda \cdot \text{every} \cdot \text{gain}` times it) and its weight :math:`\lambda`;
* ``input_grad/norm_mean``, ``input_grad/norm_max`` and the histogram ``input_grad/norm``: the
  per-sample norms :math:`\lVert\nabla_{x_i}\ell(f(x_i), y_i)\rVert_p` on the training batch,
  after its optimizer step, with the module in eval mode (one extra forward and backward).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from gradreg.lightning.callbacks._logging import (
    check_every,
    log_scalars,
    logging_due,
    logging_step,
    tensorboard,
    warn_without_tensorboard,
)
from gradreg.lightning.callbacks._penalties import penalty_scalars
from gradreg.lightning.callbacks._probe import (
    LossFn,
    cross_entropy_per_sample,
    input_gradients,
    split_batch,
)
from gradreg.lightning.dashboards.tags import (
    GRAD_NORM,
    INPUT_GRAD,
    LOSS_TOTAL,
    PARAM_GRAD,
    PARAM_GRAD_BIAS,
)
from gradreg.penalties import per_sample_norm
from gradreg.torch_compat import dtensor_type


class _Optimizer:
    """What the monitor logs of one optimizer: its tag suffix and its parameters by histogram tag
    (``param_grad/<layer>``: a layer's weights; ``param_grad_bias/<layer>``: its 1-D
    parameters)."""

    def __init__(self, suffix: str, named: list[tuple[str, nn.Parameter]]) -> None:
        self.suffix = suffix
        self.layers: dict[str, list[nn.Parameter]] = defaultdict(list)
        for name, param in named:
            group = PARAM_GRAD if param.ndim >= 2 else PARAM_GRAD_BIAS
            self.layers[f"{group}/{name.rpartition('.')[0] or name}"].append(param)
        self.backpropagated: Tensor | None = None


#: FSDP2's sharded tensor class (public from torch 2.5, private in 2.4), or None
_DTENSOR = dtensor_type()


def _whole(tensor: Tensor) -> Tensor:
    """``tensor``, or the whole tensor of a ``DTensor`` (a collective: every rank calls it)."""
    sharded = _DTENSOR is not None and isinstance(tensor, _DTENSOR)
    return tensor.full_tensor() if sharded else tensor


class GradientNormMonitor(pl.Callback):
    """Log losses, parameter-gradient norms and histograms, penalties and input-gradient norms.

    Works on any LightningModule, automatic or manual optimization (see the module docstring
    for the tags).

    Args:
        norm_type: the order ``p`` of the norms, a number > 0 or ``"inf"``.
        loss_fn: ``(outputs, targets) -> per-sample losses [B]`` of ``pl_module(inputs)`` for the
            input gradients, on ``(inputs, targets, ...)`` batches; default cross-entropy.
            ``None`` turns the input gradients off (e.g. for a GAN).
        every_n_steps: the logging interval in optimizer steps; ``None`` follows the Trainer's
            ``log_every_n_steps``.
    """

    def __init__(
        self,
        norm_type: float | str = 2.0,
        *,
        loss_fn: LossFn | None = cross_entropy_per_sample,
        every_n_steps: int | None = None,
    ) -> None:
        try:
            p = float(norm_type)
        except (TypeError, ValueError):
            p = math.nan
        if not p > 0:
            raise ValueError(
                f"norm_type must be a number > 0 or 'inf', got {norm_type!r}; use 2 for the "
                "Euclidean norm."
            )
        check_every(every_n_steps)
        self.norm_type = p
        self.loss_fn = loss_fn
        self.every_n_steps = every_n_steps
        self._optimizers: dict[int, _Optimizer] = {}
        self._backpropagated: Tensor | None = None

    @property
    def charts(self) -> tuple[str, ...]:
        """The charts of :data:`gradreg.lightning.dashboards.CHARTS` this monitor feeds."""
        charts = ("loss_total", "penalty_unweighted", "penalty_weighted", "penalty_weight",
                  "grad_norm")
        return (*charts, "input_grad") if self.loss_fn is not None else charts

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "GradientNormMonitor", "the gradient histograms")
        names = {param: name for name, param in pl_module.named_parameters()}
        self._optimizers = {}
        for index, optimizer in enumerate(trainer.optimizers):
            named = [(names[param], param) for group in optimizer.param_groups
                     for param in group["params"] if param in names]
            owners = {name.split(".", 1)[0] for name, _ in named}
            owner = owners.pop() if len(owners) == 1 else f"optimizer_{index}"
            suffix = f"/{owner}" if len(trainer.optimizers) > 1 else ""
            self._optimizers[id(optimizer)] = _Optimizer(suffix, named)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor
    ) -> None:
        loss = loss.detach()
        self._backpropagated = loss if self._backpropagated is None else self._backpropagated + loss

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        backpropagated, self._backpropagated = self._backpropagated, None
        if not logging_due(trainer, self.every_n_steps):
            return
        logged = self._optimizers[id(optimizer)]
        # a sharded parameter's (FSDP2) gradient is a DTensor: gathered whole on every rank
        grads = {layer: [_whole(p.grad) for p in params if p.grad is not None]
                 for layer, params in logged.layers.items()}
        norms = [torch.linalg.vector_norm(g.detach(), self.norm_type)
                 for layer_grads in grads.values() for g in layer_grads]
        scalars = {}
        if norms:
            total = torch.linalg.vector_norm(torch.stack(norms), self.norm_type)
            scalars[f"{GRAD_NORM}/total{logged.suffix}"] = total
        if backpropagated is not None:
            scalars[f"{LOSS_TOTAL}{logged.suffix}"] = backpropagated
        log_scalars(trainer, scalars)
        writer = tensorboard(trainer)
        if writer is not None:
            for layer, layer_grads in grads.items():
                if layer_grads:
                    values = torch.cat([g.detach().flatten() for g in layer_grads])
                    writer.add_histogram(layer, values.float().cpu(),
                                         logging_step(trainer))

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not logging_due(trainer, self.every_n_steps):
            return
        scalars = penalty_scalars(pl_module)
        if self.loss_fn is not None:
            inputs, targets = split_batch(batch, "GradientNormMonitor")
            grads = input_gradients(pl_module, inputs, targets, self.loss_fn)
            norms = per_sample_norm(grads, self.norm_type)
            scalars[f"{INPUT_GRAD}/norm_mean"] = norms.mean()
            scalars[f"{INPUT_GRAD}/norm_max"] = norms.max()
            writer = tensorboard(trainer)
            if writer is not None:
                writer.add_histogram(f"{INPUT_GRAD}/norm", norms.float().cpu(),
                                     logging_step(trainer))
        log_scalars(trainer, scalars)
