r"""Per layer, how much of the parameter gradient comes from the penalties and how much from the
task loss.

A step backpropagates :math:`L = L_\text{task} + \sum_k \lambda_k P_k`, so the gradient the
optimizer applies to the parameters :math:`\theta_l` of layer :math:`l` is the sum of two parts,

.. math::

    \frac{\partial L}{\partial \theta_l} = g^\text{task}_l + g^\text{pen}_l,\qquad
    g^\text{task}_l = \frac{\partial L_\text{task}}{\partial \theta_l},\quad
    g^\text{pen}_l = \frac{\partial \sum_k \lambda_k P_k}{\partial \theta_l}.

Every ``every_n_steps`` optimizer steps, before the step's backward, this callback computes both
parts with ``torch.autograd.grad(..., retain_graph=True)`` (the graph stays for the step's own
backward) and logs, for each layer (the parameters of one module: weight and bias together):

* ``grad_split/task/<layer>``: :math:`\lVert g^\text{task}_l\rVert_2`;
* ``grad_split/penalty/<layer>``: :math:`\lVert g^\text{pen}_l\rVert_2` (0 where the layer
  does not move the penalty, e.g. the last layer under double backpropagation of a linear one);
* ``grad_split/penalty_share/<layer>``: :math:`\lVert g^\text{pen}_l\rVert /
  (\lVert g^\text{task}_l\rVert + \lVert g^\text{pen}_l\rVert)`, in [0, 1]: 0 where the task
  alone moves the layer, 1 where the penalty alone does;
* ``grad_split/cosine/<layer>``: the cosine between the two parts (-1: the penalty pulls the
  layer against the task).

Undefined values are not logged (a chart would read a logged 0 as "orthogonal" or "no share"):
no cosine where a part is zero, no share where both are; and on a step where no penalty was
computed (``penalty=none``, a lazy penalty off its step, a GAN's generator step, whose loss has
no penalty) only ``grad_split/task/<layer>``.

Cost, on the logged steps only: one backward of the task loss and one of the penalties (which
includes their double-backward part), i.e. about twice the step's backward; on the other steps
nothing but one attribute read. It needs the module to hand over its loss terms
(:func:`gradreg.lightning.loss_terms.record_terms`), as gradreg's Classifier and GAN do; for a
GAN the parts are those of the phase's network (the parameters that require grad in that
phase), logged at each phase's backward. Under data parallelism (DDP, FSDP) every rank computes
the parts of its own batch, before the ranks' gradients are averaged, and rank 0's are logged:
the split of one rank's share of the batch, not of the averaged ``.grad``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from gradreg.lightning.callbacks._logging import check_every, log_scalars, logging_due
from gradreg.lightning.dashboards.tags import GRAD_SPLIT
from gradreg.lightning.loss_terms import TASK, request_terms, take_terms


def split_norms(parts: dict[str, tuple[Tensor, Tensor | None]]) -> dict[str, float]:
    """``grad_split/<quantity>/<layer>`` of each layer's ``(task part, penalty part)``, both
    flattened to one vector, the penalty part None where no penalty was computed; the
    undefined values left out (module docstring)."""
    scalars = {}
    for layer, (task, penalty) in parts.items():
        task_norm = float(task.norm())
        scalars[f"{GRAD_SPLIT}/task/{layer}"] = task_norm
        if penalty is None:
            continue
        penalty_norm = float(penalty.norm())
        scalars[f"{GRAD_SPLIT}/penalty/{layer}"] = penalty_norm
        if task_norm + penalty_norm > 0:
            scalars[f"{GRAD_SPLIT}/penalty_share/{layer}"] = penalty_norm / (
                task_norm + penalty_norm)
        if task_norm > 0 and penalty_norm > 0:
            scalars[f"{GRAD_SPLIT}/cosine/{layer}"] = float(task @ penalty) / (
                task_norm * penalty_norm)
    return scalars


class GradientSplit(pl.Callback):
    """Log, per layer, the norms of the task's and the penalties' parts of the parameter
    gradient (module docstring).

    Args:
        every_n_steps: the interval in optimizer steps (each logged step costs about two extra
            backwards); ``None`` follows the Trainer's ``log_every_n_steps``.
    """

    charts = ("grad_split",)

    def __init__(self, every_n_steps: int | None = 50) -> None:
        check_every(every_n_steps)
        self.every_n_steps = every_n_steps
        self._asked = self._got = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        due = logging_due(trainer, self.every_n_steps)
        self._asked |= due
        request_terms(pl_module, due)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._asked and not self._got:
            rank_zero_warn(
                f"GradientSplit got no loss terms from {type(pl_module).__name__}, so it logged "
                "nothing: call gradreg.lightning.loss_terms.record_terms(self, {'task': loss, "
                "name: weighted_penalty, ...}) right before the backward (gradreg's Classifier "
                "and GAN do).")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        request_terms(pl_module, False)
        take_terms(pl_module)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: Tensor) -> None:
        terms = take_terms(pl_module)
        if terms is None:
            return
        self._got = True
        if TASK not in terms:
            raise ValueError(f"GradientSplit needs the task loss among the terms the module "
                             f"records under {TASK!r}; it recorded {sorted(terms)}.")
        named = [(name, param) for name, param in pl_module.named_parameters()
                 if param.requires_grad]
        params = [param for _, param in named]
        task = _grads(terms[TASK], params)
        penalties = [term for name, term in terms.items() if name != TASK]
        penalty = _grads(sum(penalties), params) if penalties else [None] * len(params)
        parts: dict[str, tuple[list[Tensor], list[Tensor]]] = {}
        for (name, _), task_grad, penalty_grad in zip(named, task, penalty, strict=True):
            layer_task, layer_penalty = parts.setdefault(layer_of(name), ([], []))
            layer_task.append(task_grad.flatten())
            if penalty_grad is not None:
                layer_penalty.append(penalty_grad.flatten())
        log_scalars(trainer, split_norms({
            layer: (torch.cat(t), torch.cat(p) if penalties else None)
            for layer, (t, p) in parts.items()}))

    def split_layers(self, pl_module: pl.LightningModule) -> list[str]:
        """The layers this callback logs (of the parameters that require grad), for the
        layout's one chart per layer."""
        return list(dict.fromkeys(layer_of(name) for name, param in pl_module.named_parameters()
                                  if param.requires_grad))


def layer_of(name: str) -> str:
    """``backbone.fc1.weight`` -> ``backbone.fc1``: the module a parameter belongs to."""
    return name.rpartition(".")[0] or name


def _grads(term: Tensor, params: list[Tensor]) -> list[Tensor]:
    """:math:`\\partial\\,\\text{term}/\\partial p` for each of ``params`` (zeros where it does
    not depend on one), keeping the graph for the step's backward."""
    grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(param) if grad is None else grad.detach()
            for param, grad in zip(params, grads, strict=True)]
