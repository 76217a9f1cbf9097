r"""Parameter-gradient penalties (``param_grad_norm``, ``sam``, ``asam``, ``gr``) in Hugging Face's
``Trainer``.

:class:`PenaltyMixin` adds penalties on ``points="parameters"`` to ``transformers.Trainer`` or
any trainer built on it (TRL's ``SFTTrainer``, ``GRPOTrainer``...) without a ``compute_loss``
of the user's::

    from gradreg.hf_trainer import PenalizedTrainer
    from gradreg.penalties import param_grad_norm, sam

    trainer = PenalizedTrainer(model=model, args=args, train_dataset=data,
                               penalties={"gnp": param_grad_norm(0.01, method="finite_difference")})
    trainer.train()

    class SAMSFTTrainer(PenaltyMixin, SFTTrainer): ...   # TRL: the mixin first
    SAMSFTTrainer(..., penalties={"sam": sam(0.05)})

    class GRPOTrainerGR(PenaltyMixin, GRPOTrainer): ...  # GR in place of a KL term
    GRPOTrainerGR(..., penalties={"gr": gr(1e-3, step=1e-3)})  # g + (λ/ε)(∇L(θ + ε g) - g)

In training, the trainer's own loss :math:`L` (``super().compute_loss``: the model's loss, or
``compute_loss_func``, normalized as the trainer normalizes it) becomes :math:`L + \sum_k P_k`,
each penalty due at the step (``penalty.due()``, once per optimizer step) evaluated at the
parameters that require grad; the loss at shifted parameters is the same call on the same
inputs, its forward drawing the random numbers of the first (dropout's masks: the state is
captured before the trainer's forward) and leaving BatchNorm's running statistics as one forward
does. The first finite-difference penalty takes the loss's gradient for the trainer
(:func:`~gradreg.penalties.two_pass.penalized_loss`): the step costs the hand-written two passes
(Zhao et al.; SAM's two steps; gradientregularization_trl's), and the trainer's backward,
clipping and optimizer run unchanged.
Evaluation (no grad, or the model in eval mode) computes the loss alone.

Refused in one line: penalties on other points (a trainer's loss is a batch mean, not per-sample
outputs at points), and ``gradient_accumulation_steps > 1``: the penalty of the accumulated
batch's gradient needs that gradient before any micro-batch's second pass, which a trainer's
backward per micro-batch does not give (:mod:`gradreg.penalties.accumulation` is the plain-loop
form that does).

``transformers`` (and ``accelerate``, which its ``Trainer`` needs) are the ``transformers``
extra; :class:`PenalizedTrainer` imports them on first use, and names the extra in one line
where one is missing. :class:`PenaltyMixin` itself imports
nothing of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from gradreg.autograd import GradientError
from gradreg.extras import require
from gradreg.penalties.mechanism import GradientPenalty
from gradreg.penalties.param_gradient import LossAt
from gradreg.penalties.randomness import GeneratorState
from gradreg.penalties.two_pass import penalized_loss

__all__ = ["PenalizedTrainer", "PenaltyMixin"]  # noqa: F822 (PenalizedTrainer: built on use)


class PenaltyMixin:
    """Adds ``penalties`` (name -> :class:`~gradreg.penalties.GradientPenalty` on
    ``points="parameters"``) to a ``transformers.Trainer`` subclass's training loss (module
    docstring). ``penalty_values``: the detached weighted penalties of the latest step."""

    def __init__(self, *args: Any, penalties: Mapping[str, GradientPenalty] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        penalties = dict(penalties or {})
        for name, penalty in penalties.items():
            if not isinstance(penalty, GradientPenalty) or penalty.config.points != "parameters":
                got = (f"points={penalty.config.points!r}" if isinstance(penalty, GradientPenalty)
                       else type(penalty).__name__)
                raise GradientError(
                    f"penalty {name!r}: a Trainer adds penalties on points='parameters' "
                    f"(param_grad_norm, sam, asam, gr), got {got}: a trainer's loss is a batch "
                    "mean, not per-sample outputs at points.")
        self.penalties = penalties
        self.penalty_values: dict[str, Tensor] = {}

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Tensor | int | None = None) -> Any:
        parent = super().compute_loss  # type: ignore[misc]
        if not self.penalties or not (model.training and torch.is_grad_enabled()):
            return parent(model, inputs, return_outputs=return_outputs,
                          num_items_in_batch=num_items_in_batch)
        due = {name: gp for name, gp in self.penalties.items() if gp.due()}
        accumulation = self.args.gradient_accumulation_steps  # type: ignore[attr-defined]
        if due and accumulation > 1:
            raise GradientError(
                f"penalties {sorted(due)} penalize the gradient of the whole batch's loss, "
                f"which gradient_accumulation_steps={accumulation} splits: each micro-batch "
                "would penalize its own gradient; use per_device_train_batch_size for the whole "
                "batch, or the two-phase loop gradreg.penalties.accumulation.accumulated_backward")
        state = GeneratorState.capture(*(v for v in inputs.values() if isinstance(v, Tensor)))
        result = parent(model, inputs, return_outputs=return_outputs,
                        num_items_in_batch=num_items_in_batch)
        loss, outputs = result if return_outputs else (result, None)

        def loss_at_parameters() -> Tensor:
            return parent(model, inputs, num_items_in_batch=num_items_in_batch)

        params = [p for p in model.parameters() if p.requires_grad]
        task, values = loss, {}
        for name, gp in due.items():
            at = LossAt(loss_at_parameters, loss, state)
            if task is loss and gp.needs_callable:  # the first finite difference: two passes
                task, values[name] = penalized_loss(gp, at, params, retain_graph=len(due) > 1)
            else:
                values[name] = gp(at if gp.needs_callable else loss, params)
        self.penalty_values = {name: value.detach() for name, value in values.items()}
        total = task + sum(values.values())
        return (total, outputs) if return_outputs else total


def __getattr__(name: str) -> type:
    if name != "PenalizedTrainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require("transformers", "gradreg.hf_trainer.PenalizedTrainer", "transformers", "accelerate")
    from transformers import Trainer

    trainer = type("PenalizedTrainer", (PenaltyMixin, Trainer), {
        "__module__": __name__,
        "__doc__": "``transformers.Trainer`` with :class:`PenaltyMixin`: pass ``penalties=``."})
    globals()[name] = trainer
    return trainer
