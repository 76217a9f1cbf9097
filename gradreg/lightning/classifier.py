r"""A classifier trained with any number of gradient penalties (automatic optimization).

One training step:

.. math::

    L = \frac1B \sum_i \ell_i + \sum_k P_k, \qquad \ell_i = \mathrm{CE}(f(x_i), y_i),

where each penalty :math:`P_k` is evaluated where its ``points`` say:

* ``"inputs"``: the gradient w.r.t. :math:`x_i` of the per-sample loss :math:`\ell_i`
  (``of="loss"``: double backprop) or of the model outputs :math:`f(x_i)` (``of="outputs"``:
  jacobian, derivative);
* ``"activations"``: the gradient of :math:`\ell_i` w.r.t. the outputs of the named submodules
  (``layers``) of the backbone;
* ``"parameters"``: the gradient of the mean loss w.r.t. all trainable parameters.

The step returns :math:`L`, so Lightning's gradient accumulation, clipping and DDP apply to the
penalty as to the loss. Penalties are computed from per-sample values (``reduction="none"``), so
for a backbone without batch interaction (no BatchNorm) a batch split into micro-batches gives the
same gradient as the whole batch. Lightning divides each of ``accumulate_grad_batches``
micro-batches' :math:`L` by their number, which turns means over the micro-batches into the mean
over the accumulated batch; a penalty with ``reduction="sum"`` is multiplied by that number, so
that it is the sum over the accumulated batch too (one batch of 8 and two accumulated batches of
4 give the same gradient). A parameter-gradient penalty (``points="parameters"``) is not a mean
over samples: it is the norm of the gradient of the whole accumulated batch's loss, which no sum
of the micro-batches' penalties gives (each would penalize its own micro-batch's gradient); it is
taken in two phases (:mod:`gradreg.penalties.accumulation`): each micro-batch's step takes its
gradient, and the one after which the optimizer steps runs the second pass of every micro-batch
of the window (kept until then with the random state of its forward), so the step equals one
big batch's within float rounding (one such penalty, ``every=1``). Under DDP (and FSDP2's
:class:`~gradreg.lightning.sharded.ShardedPenaltyStrategy`, on the gathered parameters) a
batch is also split over the ranks, and the same two phases take the penalty of the whole
batch's gradient (the ranks' mean, one all-reduce before the direction: ``over_ranks`` of
:class:`~gradreg.penalties.accumulation.Accumulation`), with or without accumulation (one
parameter penalty), rather than each rank's own (global batches' uneven slices weighted by
their samples). DDP averages the ranks' gradients (a global-batch strategy weights them by
their share of the batch), so ``reduction="sum"`` on more
than one rank is refused.

Validation and test differentiate too (FGSM, PGD, input-gradient norm): they need
``Trainer(inference_mode=False)``; the steps re-enable grad with ``torch.enable_grad()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from lightning import Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn

from gradreg import gradient
from gradreg.evaluation.metrics import accuracy, fgsm, pgd
from gradreg.lightning.compat import accumulating, attached_trainer
from gradreg.lightning.global_batch import slice_rows
from gradreg.lightning.loss_terms import TASK, record_terms, terms_requested
from gradreg.lightning.penalized import (
    OptimizerFactory,
    PenalizedModule,
    check_penalties,
    settle_finite_checks,
)
from gradreg.lightning.precision import loss_scale
from gradreg.lightning.sharded import ShardedPenaltyStrategy
from gradreg.penalties import GradientPenalty, Window, as_points, step_terms

CLASSIFIER_POINTS = ("inputs", "activations", "parameters")

INFERENCE_MODE_ERROR = (
    "validation/test of a Classifier takes input gradients (FGSM, gradient norm), which "
    "torch.inference_mode() forbids: build the Trainer with inference_mode=False."
)


def over_ranks(trainer: Trainer | None) -> bool:
    """Whether each rank trains on its share of the step's batch under DDP (more than one
    rank), whose parameter penalties are then of the whole batch's gradient."""
    return (trainer is not None and trainer.world_size > 1
            and isinstance(trainer.strategy, (DDPStrategy, ShardedPenaltyStrategy)))


class Classifier(PenalizedModule):
    """Cross-entropy classification of ``backbone(x)`` plus the penalties (see module docstring).

    Args:
        backbone: maps a batch ``x`` to logits ``[B, classes]``.
        penalties: name -> penalty; held in an ``nn.ModuleDict`` so their state is checkpointed.
            Critic/generator points (real, fake, interpolates, perturbed, latents) raise
            ``ValueError``: they need a GAN.
        optimizer: builds the optimizer from the parameters (default Adam, lr 1e-3).
        fgsm_eps: the FGSM step size for the adversarial accuracy in validation and test; also
            the radius of the PGD ball.
        pgd_steps: steps of the PGD attack (step size 2.5 eps / steps, random start drawn from
            a generator seeded with the batch index); 0 turns PGD accuracy off.
        input_range: ``(low, high)`` that FGSM and PGD examples are clipped to, or ``None``.
        input_shape: the shape of one sample, for Lightning's model summary.
    """

    def __init__(
        self,
        backbone: nn.Module,
        penalties: Mapping[str, GradientPenalty] | None = None,
        *,
        optimizer: OptimizerFactory | None = None,
        fgsm_eps: float = 0.1,
        pgd_steps: int = 10,
        input_range: Sequence[float] | None = (0.0, 1.0),
        input_shape: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        penalties = dict(penalties or {})
        check_penalties(penalties, backbone, CLASSIFIER_POINTS, "Classifier")
        for key, gp in penalties.items():
            if gp.needs_callable and gp.config.points not in ("inputs", "parameters"):
                raise ValueError(
                    f"penalty {key!r} (points={gp.config.points!r}) asks for its own forward pass "
                    f"(subsample={gp.config.subsample}, chunks={gp.config.chunks}), which a "
                    "Classifier runs at its inputs only: use subsample=1 and chunks=1 for this "
                    "penalty"
                )
        self.save_hyperparameters(ignore=["backbone", "penalties", "optimizer"])
        self.backbone = backbone
        self.penalties = nn.ModuleDict(penalties)
        self._window: Window | None = None  # under accumulate_grad_batches and DDP
        self.optimizer = optimizer or partial(torch.optim.Adam, lr=1e-3)
        if not (isinstance(pgd_steps, int) and pgd_steps >= 0):
            raise ValueError(f"pgd_steps must be an integer >= 0 (0: no PGD), got {pgd_steps!r}")
        if not (isinstance(fgsm_eps, (int, float)) and not isinstance(fgsm_eps, bool)
                and math.isfinite(fgsm_eps) and fgsm_eps >= 0):
            # a negative step descends the loss: the attack helps, FGSM accuracy above clean
            raise ValueError(f"fgsm_eps must be a finite number >= 0 (the L-inf radius of the "
                             f"attacks), got {fgsm_eps!r}")
        self.fgsm_eps = fgsm_eps
        self.pgd_steps = pgd_steps
        self.input_range = None if input_range is None else tuple(input_range)
        self.input_shape = None if input_shape is None else tuple(input_shape)

    @property
    def example_input_array(self) -> Tensor | None:
        """One zero sample for Lightning's model summary, in the dtype and on the device of the
        parameters (so that ``precision="64-true"`` or a bf16 model summarizes too)."""
        if self.input_shape is None:
            return None
        parameter = next(self.backbone.parameters())
        return torch.zeros(1, *self.input_shape, dtype=parameter.dtype, device=parameter.device)

    def forward(self, x: Tensor) -> Tensor:
        return self.backbone(x)

    def losses(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        r"""The mean task loss and the weighted penalties due at this step (``gp.due()``), by
        :func:`~gradreg.penalties.step_terms`.

        A parameter-gradient penalty by finite difference (``param_grad_norm``, ``sam``) takes
        the task loss's gradient for it (:func:`~gradreg.penalties.penalized_loss`):
        the returned task loss then carries the whole step's gradient of the two (two passes,
        the hand-written recipe's cost) and the penalty only its value, unless a callback asked
        for the terms (:func:`~gradreg.lightning.loss_terms.request_terms`: each term carries
        its own gradient). Under ``accumulate_grad_batches`` and DDP (the ranks' mean) a
        parameter penalty is that of the accumulated batch's gradient, in two phases
        (:class:`~gradreg.penalties.Window`): each micro-batch's task term carries its loss's
        gradient :math:`g_k` (Lightning divides it by the count :math:`N`, so ``.grad`` sums
        :math:`\bar g`); on the micro-batch after which the optimizer steps, the penalty
        :math:`c\,P(\bar g)` is returned and the task term also carries :math:`N c\,\bar H
        v`, from the second phase over the window's micro-batches (kept with their random
        states until then)."""
        trainer = attached_trainer(self)
        window = self._window_of(trainer)
        terms = step_terms(
            self.penalties, self.backbone, partial(F.cross_entropy, reduction="none"), x, y,
            params=self._trainable(), accumulation=window,
            last=trainer is None or not accumulating(trainer),
            rows=slice_rows(trainer, len(x)) if window is not None and any(  # global batches:
                gp.config.points == "parameters" for gp in self.penalties.values())  # slices
            else None,  # weighted by their samples, for a penalty of the whole batch's gradient
            loss_scale=loss_scale(trainer), split=terms_requested(self))
        return terms.task, terms.penalties

    def _window_of(self, trainer: Trainer | None) -> Window | None:
        """The micro-batches and ranks of the trainer's optimizer step, kept from step to step
        (their first phases); None where the step's batch is not split."""
        if trainer is None:
            return None
        size, ranks = trainer.accumulate_grad_batches, over_ranks(trainer)
        if self._window is None or (self._window.size, self._window.over_ranks) != (size, ranks):
            self._window = Window(size, over_ranks=ranks)
        return self._window if self._window.divided else None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, penalties = self.losses(*batch)
        total = loss + sum(penalties.values())
        record_terms(self, {TASK: loss, **penalties})  # for GradientSplit, on its steps
        self.log("train/loss", loss)
        # in the logger as penalty/weighted/penalties.<name> and loss/total (the monitor's)
        self.log_dict({f"train/penalty/{name}": value for name, value in penalties.items()},
                      logger=False)
        self.log("train/total", total, prog_bar=True, logger=False)
        return total

    def on_train_epoch_end(self) -> None:
        settle_finite_checks(self.penalties)

    def on_fit_start(self) -> None:
        """Refuse per-sample ``reduction="sum"`` penalties on more than one rank (DDP averages
        the ranks' gradients, which makes a sum the mean of the ranks' sums), more than one
        parameter-gradient penalty with gradient accumulation or under DDP, and a lazy one with
        gradient accumulation (module docstring)."""
        parameter = {name: gp for name, gp in self.penalties.items()
                     if gp.config.points == "parameters"}
        accumulated = self.trainer.accumulate_grad_batches
        lazy = accumulated > 1 and any(gp.config.every > 1 for gp in parameter.values())
        if (accumulated > 1 or over_ranks(self.trainer)) and (len(parameter) > 1 or lazy):
            split = (f"accumulate_grad_batches={accumulated}" if accumulated > 1 else
                     f"DDP over {self.trainer.world_size} ranks")
            raise ValueError(
                f"penalties {sorted(parameter)} with {split}: the penalty of the whole batch's "
                "gradient is taken for one parameter penalty (computed at every step under "
                "accumulation, every=1); use one, or a batch of the whole size in one process")
        if self._window is not None:
            self._window.clear()
        summed = sorted(name for name, gp in self.penalties.items()
                        if gp.config.reduction == "sum" and gp.config.per_sample)
        if summed and self.trainer.world_size > 1:
            raise ValueError(
                f"penalties {summed} sum over samples (reduction='sum'), but DDP averages the "
                f"gradients of its {self.trainer.world_size} ranks, which would make the sum "
                "the mean of the ranks' sums: use reduction='mean' (with the weight times the "
                "global batch size for the same penalty), or train on one process")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "test")

    def _evaluate(self, batch: tuple[Tensor, Tensor], batch_idx: int, stage: str) -> None:
        """Loss, accuracy, FGSM and PGD accuracy, mean input-gradient norm mean_i ||dl_i/dx_i||."""
        if torch.is_inference_mode_enabled():
            raise RuntimeError(INFERENCE_MODE_ERROR)
        x, y = batch
        with torch.enable_grad():
            x = as_points(x)
            logits = self.backbone(x)
            per_sample = F.cross_entropy(logits, y, reduction="none")
            grad = gradient(per_sample.sum(), x, create_graph=False)
        adversarial_logits = self.backbone(fgsm(x, grad, self.fgsm_eps, self.input_range))
        log = partial(self.log, sync_dist=True)  # averaged over DDP ranks
        log(f"{stage}/loss", per_sample.mean())
        log(f"{stage}/acc", accuracy(logits, y), prog_bar=True)
        log(f"{stage}/acc_fgsm", accuracy(adversarial_logits, y), prog_bar=True)
        log(f"{stage}/input_grad_norm", grad.flatten(1).norm(dim=1).mean())
        if self.pgd_steps:
            start = torch.Generator(device=x.device).manual_seed(batch_idx)
            with torch.enable_grad():
                attacked = pgd(partial(self._summed_loss, y=y), x, self.fgsm_eps,
                               steps=self.pgd_steps, bounds=self.input_range, generator=start)
            log(f"{stage}/acc_pgd", accuracy(self.backbone(attacked), y), prog_bar=True)

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.backbone.parameters() if p.requires_grad]

    def _summed_loss(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self.backbone(x), y, reduction="sum")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters())
