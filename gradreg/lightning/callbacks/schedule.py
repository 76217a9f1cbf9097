r"""Warm-up and anneal of penalty weights.

With :math:`s = \operatorname{clip}\big((t - \text{begin}) / \text{steps}, 0, 1\big)` at step
:math:`t` of the optimizer the penalty belongs to (what is counted: :class:`PenaltyWeightSchedule`),
the weight is

* ``constant``: :math:`w(t) = \text{end}`;
* ``linear``:   :math:`w(t) = \text{start} + (\text{end} - \text{start})\, s`;
* ``cosine``:   :math:`w(t) = \text{end} + (\text{start} - \text{end})\,(1 + \cos \pi s) / 2`;
* ``step``:     :math:`w(t) = \text{start}` for :math:`s < 1`, then :math:`\text{end}`.

All but ``constant`` start at ``start`` on step ``begin`` and hold ``end`` from step
``begin + steps`` on: a warm-up has ``start < end``, an anneal ``start > end``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from gradreg.lightning.callbacks._penalties import named_penalties
from gradreg.penalties import GradientPenalty

KINDS = ("constant", "linear", "cosine", "step")


def shift_size(penalty: GradientPenalty) -> str | None:
    """The size of the shift of a penalty that shifts the parameters (``radius=0.05``), as its
    configuration has it; None for the other penalties."""
    method = penalty.config.method
    if penalty.config.points != "parameters" or method.name != "finite_difference":
        return None
    name = type(method).step_field(method.flat())
    value = getattr(method, name)
    return f"{name}={'its default' if value is None else value}"


@dataclass(frozen=True)
class WeightSchedule:
    """The weight :math:`w(t)` of the module docstring; plain values, as a config sets them."""

    kind: str = "linear"
    start: float = 0.0
    end: float = 1.0
    steps: int = 1000
    begin: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown schedule kind {self.kind!r}; choose one of {list(KINDS)}.")
        for name in ("start", "end"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"{name}={value!r}: a penalty weight must be a finite number >= 0 "
                    "(0 turns the penalty off)."
                )
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(
                f"steps={self.steps!r}: the ramp needs an int number of optimizer steps >= 1."
            )
        if not isinstance(self.begin, int) or self.begin < 0:
            raise ValueError(
                f"begin={self.begin!r}: the first step of the ramp must be an int >= 0."
            )

    def __call__(self, step: int) -> float:
        s = min(max((step - self.begin) / self.steps, 0.0), 1.0)
        if self.kind == "constant":
            return float(self.end)
        if self.kind == "linear":
            return self.start + (self.end - self.start) * s
        if self.kind == "cosine":
            return self.end + (self.start - self.end) * (1.0 + math.cos(math.pi * s)) / 2.0
        return float(self.start if s < 1.0 else self.end)


class PenaltyWeightSchedule(pl.Callback):
    r"""Set ``.weight`` of the module's :class:`GradientPenalty` submodules to :math:`w(t)`.

    What :math:`t` counts: the optimizer steps taken so far by the optimizer the penalty belongs
    to, before the batch about to run.

    * Automatic optimization: ``trainer.global_step`` (one per optimizer step, so with
      ``accumulate_grad_batches=k`` one per ``k`` batches).
    * Manual optimization (gradreg's GAN: ``n_critic`` critic steps per generator step): the
      penalty's own step counter, advanced by each call of :meth:`GradientPenalty.due`, which the
      module calls once per step of the penalty's optimizer: critic penalties count critic steps,
      generator penalties (path length) generator steps. A 100-step ramp of WGAN-GP's weight
      ends after exactly 100 critic steps, not after 100 steps of both networks. A penalty whose
      counter never advances (a module that does not call ``due()``) is an error at the end of
      the first epoch.

    Before each training batch the weight of every penalty (or of those named in ``penalties``,
    dotted module paths such as ``"penalties.gp"``) becomes :math:`w(t)`;
    :class:`~gradreg.lightning.callbacks.GradientNormMonitor` logs every penalty's weight as
    ``penalty/weight/<module path>``, with or without a schedule (x axis: Lightning's logging
    step, which in the GAN counts the steps of both optimizers). The schedule and the last applied
    steps and weights are saved in checkpoints and restored on resume.

    The schedule sets the weight, the factor of the penalty's value and gradient, and nothing of
    its configuration: a penalty that shifts the parameters (``sam(rho)``, ``asam``, ``gr``,
    ``param_grad_norm`` by finite difference) keeps the shift of its configuration. For SAM, whose
    :math:`\rho` is both the weight and the radius, a weight :math:`w` gives the gradient
    :math:`\nabla L(\theta) + (w/\rho)(\nabla L(\theta + \rho \hat g) - \nabla L(\theta))`:
    a ramp of :math:`w` from 0 to :math:`\rho` goes from plain training to SAM at the fixed
    radius :math:`\rho`, never SAM at radius :math:`w`. Each such penalty is named in one info
    line when the fit starts.

    Args:
        kind, start, end, steps, begin: the :class:`WeightSchedule` (module docstring).
        penalties: module paths of the penalties to schedule; ``None`` schedules all of them.
    """

    def __init__(
        self,
        kind: str = "linear",
        *,
        start: float = 0.0,
        end: float = 1.0,
        steps: int = 1000,
        begin: int = 0,
        penalties: Sequence[str] | None = None,
    ) -> None:
        if isinstance(penalties, str):
            raise ValueError(
                f"penalties must be a list of module paths, got the string {penalties!r}; "
                f"write penalties=[{penalties!r}]."
            )
        self.schedule = WeightSchedule(kind, start, end, steps, begin)
        self.penalties = None if penalties is None else tuple(penalties)
        self.optimizer_steps: dict[str, int] = {}
        self.weights: dict[str, float] = {}
        self._targets: dict[str, GradientPenalty] = {}

    @property
    def state_key(self) -> str:
        return self._generate_state_key(penalties=self.penalties)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        found = named_penalties(pl_module)
        if not found:
            raise ValueError(
                f"PenaltyWeightSchedule found no GradientPenalty in {type(pl_module).__name__}: "
                "assign the penalties as attributes (or in an nn.ModuleDict) of the module."
            )
        unknown = sorted(set(self.penalties or ()) - set(found))
        if unknown:
            raise ValueError(
                f"PenaltyWeightSchedule: no penalty at {unknown}; the module's penalties are "
                f"{sorted(found)}."
            )
        names = found if self.penalties is None else self.penalties
        self._targets = {name: found[name] for name in names}
        for name, penalty in self._targets.items():
            shift = shift_size(penalty)
            if shift is not None:
                rank_zero_info(
                    f"PenaltyWeightSchedule: {name!r} shifts the parameters by {shift}, which the "
                    "schedule does not change: its weight w scales the correction to the "
                    f"gradient at the shifted parameters (SAM's step where w equals its rho).")

    @staticmethod
    def counted_step(trainer: pl.Trainer, pl_module: pl.LightningModule,
                       penalty: GradientPenalty) -> int:
        """:math:`t` of ``penalty`` (class docstring): the global step, or in manual
        optimization the penalty's own step counter."""
        if pl_module.automatic_optimization:
            return trainer.global_step
        return penalty.steps_taken

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        for name, penalty in self._targets.items():
            self.optimizer_steps[name] = self.counted_step(trainer, pl_module, penalty)
            self.weights[name] = penalty.weight = self.schedule(self.optimizer_steps[name])

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.automatic_optimization or trainer.global_step == 0:
            return
        idle = sorted(name for name, penalty in self._targets.items()
                      if penalty.steps_taken == 0)
        if idle:
            raise ValueError(
                f"PenaltyWeightSchedule: the step counter of {idle} did not advance over an epoch "
                f"of {trainer.global_step} optimizer steps. In manual optimization the schedule "
                "counts the steps of each penalty's own optimizer through penalty.due(): call "
                "it once per step of that optimizer (and compute the penalty when it is True)."
            )

    def state_dict(self) -> dict[str, Any]:
        return {**asdict(self.schedule), "optimizer_steps": dict(self.optimizer_steps),
                "weights": dict(self.weights)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = WeightSchedule(**{f.name: state_dict[f.name] for f in fields(WeightSchedule)})
        if saved != self.schedule:
            rank_zero_warn(
                f"the checkpoint was trained with {saved}; resuming with {self.schedule} from "
                f"optimizer steps {state_dict.get('optimizer_steps', state_dict.get('step'))}."
            )
        self.optimizer_steps = dict(state_dict.get("optimizer_steps", {}))
        self.weights = dict(state_dict.get("weights", {}))
