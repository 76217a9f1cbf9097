r"""Watch what a penalty does to the gradients: parameter, input and penalty values over training.

Every ``log_every_n_steps`` optimizer steps (or ``every_n_steps``) the monitor writes

* ``grad_{p}_norm/<param>`` and ``grad_{p}_norm_total``: Lightning's :func:`grad_norm` of the
  gradients an optimizer is about to apply, :math:`\lVert\partial L/\partial\theta\rVert_p` per
  parameter and over all of them; with several optimizers each logs its own parameters and the
  total gets the suffix ``/<owner>``: the submodule that holds all of that optimizer's
  parameters (``critic``, ``generator``), or ``optimizer_<i>`` where no one submodule does;
* ``input_grad/norm_mean``, ``input_grad/norm_max`` and the histogram ``input_grad/norm``: the
  per-sample norms :math:`\lVert\nabla_{x_i}\ell(f(x_i), y_i)\rVert_p` on the training batch,
  after its optimizer step, with the module in eval mode (one extra forward and backward);
* ``penalty/<module path>``: ``last_value`` of every :class:`~gradreg.penalties.GradientPenalty`
  submodule, the unweighted penalty of its last call (lazy penalties keep their last value).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.optim import Optimizer

from gradreg.lightning.callbacks._logging import (
    check_every,
    log_scalars,
    logging_due,
    logging_step,
    tensorboard,
    warn_without_tensorboard,
)
from gradreg.lightning.callbacks._penalties import named_penalties
from gradreg.lightning.callbacks._probe import (
    LossFn,
    cross_entropy_per_sample,
    input_gradients,
    split_batch,
)
from gradreg.lightning.dashboards import INPUT_GRAD, PENALTY
from gradreg.penalties import per_sample_norm


class _Parameters(nn.Module):
    """Some named parameters as a module, for Lightning's ``grad_norm`` (it reads only these)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self._named = named

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._named)


class GradientNormMonitor(pl.Callback):
    """Log parameter-gradient norms, input-gradient norm statistics and penalty values.

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
        self._optimizers: dict[int, tuple[str, _Parameters]] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.loss_fn is not None:
            warn_without_tensorboard(trainer, "GradientNormMonitor", "the input_grad histogram")
        names = {param: name for name, param in pl_module.named_parameters()}
        self._optimizers = {}
        for index, optimizer in enumerate(trainer.optimizers):
            named = [(names[param], param) for group in optimizer.param_groups
                     for param in group["params"] if param in names]
            owners = {name.split(".", 1)[0] for name, _ in named}
            label = owners.pop() if len(owners) == 1 else f"optimizer_{index}"
            self._optimizers[id(optimizer)] = (label, _Parameters(named))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not logging_due(trainer, self.every_n_steps):
            return
        label, parameters = self._optimizers[id(optimizer)]
        norms = grad_norm(parameters, self.norm_type)
        total = f"grad_{self.norm_type}_norm_total"
        if len(self._optimizers) > 1 and total in norms:
            norms[f"{total}/{label}"] = norms.pop(total)
        log_scalars(trainer, norms)

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
        scalars = {
            f"{PENALTY}/{name}": penalty.last_value
            for name, penalty in named_penalties(pl_module).items()
            if penalty.last_value is not None
        }
        if self.loss_fn is not None:
            inputs, targets = split_batch(batch, "GradientNormMonitor")
            grads = input_gradients(pl_module, inputs, targets, self.loss_fn)
            norms = per_sample_norm(grads, self.norm_type)
            scalars[f"{INPUT_GRAD}/norm_mean"] = norms.mean()
            scalars[f"{INPUT_GRAD}/norm_max"] = norms.max()
            writer = tensorboard(trainer)
            if writer is not None:
                writer.add_histogram(f"{INPUT_GRAD}/norm", norms, logging_step(trainer))
        log_scalars(trainer, scalars)
