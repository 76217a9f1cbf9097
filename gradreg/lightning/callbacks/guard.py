r"""Catch gradients carried over from one optimizer step to the next, and non-finite gradients.

``.grad`` accumulates across backward calls until it is reset (``zero_grad()``, or
``p.grad = None``). Within one optimizer step that is gradient accumulation; across steps it is a
bug: step :math:`k+1` applies :math:`g_k + g_{k+1}` instead of :math:`g_{k+1}`.

How a carried-over gradient is detected, for any mix of automatic and manual optimization:

1. After an optimizer steps (``register_step_post_hook``), each of its parameters' gradient
   tensors is recorded as *applied*.
2. A reset is observed where it matters: a hook on each parameter (``Tensor.register_hook``) runs
   inside every backward just before the new gradient is added to ``p.grad``; if ``p.grad`` is
   then ``None`` or all zeros, the parameter was reset and its record is dropped. The hook only
   ever drops records, and only on a real reset, so ``torch.autograd.grad`` calls (which fire it
   too, without accumulating) cannot hide or invent a carry-over.
3. When the optimizer is about to apply gradients again (``on_before_optimizer_step``, after all
   backward calls of the step), a parameter is flagged iff its ``.grad`` is still the recorded
   tensor object, was never seen reset, and is not all zeros.

So Lightning's own zeroing (automatic optimization, also with ``accumulate_grad_batches=k``,
whose micro-batches all add onto a gradient reset at the window's start), a manual loop that
calls ``zero_grad()`` (with or without ``set_to_none``), and gradients assigned as new tensors
are never flagged; a manual loop that forgets ``zero_grad()`` is flagged on its second step.

Non-finite gradients (NaN, Inf) are checked at the same point, after backward and before the
optimizer step, unless the precision plugin has a ``GradScaler`` (fp16 mixed precision on GPU):
there an Inf is the scaler's overflow signal, and the scaler itself skips that step and lowers
its scale. Both checks act as ``action`` says: ``"raise"`` a :class:`gradreg.GradientError`,
``"warn"``, or ``"skip"`` the step (warn, and drop the optimizer's gradients so that the step
changes no parameter).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from gradreg import GradientError

ACTIONS = ("raise", "warn", "skip")


def _parameters(optimizer: Optimizer) -> Iterator[Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _nonfinite(params: list[Tensor]) -> list[Tensor]:
    """The parameters whose gradient holds NaN or Inf. One device-side reduction over all of
    them and one host read per step (the step must wait for the verdict to be skipped or
    stopped), instead of one read per parameter; per-parameter flags are read only when one
    is not finite."""
    if not params:
        return []
    device = params[0].grad.device
    finite = torch.stack([torch.isfinite(p.grad).all().to(device) for p in params])
    if bool(finite.all()):
        return []
    return [p for p, ok in zip(params, finite.tolist(), strict=True) if not ok]


class AccumulationGuard(pl.Callback):
    """Flag gradients not reset between optimizer steps and non-finite gradients.

    Args:
        action: ``"raise"`` (:class:`gradreg.GradientError`), ``"warn"``, or ``"skip"`` (warn and
            skip the optimizer step by dropping its gradients).
    """

    def __init__(self, action: str = "raise") -> None:
        if action not in ACTIONS:
            raise ValueError(
                f"unknown action {action!r}; choose 'raise' (stop training), 'warn' (warn and "
                "go on) or 'skip' (warn and skip the optimizer step)."
            )
        self.action = action
        self._applied: dict[Tensor, weakref.ref] = {}
        self._names: dict[Tensor, str] = {}
        self._handles: list[RemovableHandle] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._names = {param: name for name, param in pl_module.named_parameters()}
        hooked: set[Tensor] = set()
        for optimizer in trainer.optimizers:
            self._handles.append(optimizer.register_step_post_hook(self._record_applied))
            for param in _parameters(optimizer):
                if param.requires_grad and param not in hooked:
                    hooked.add(param)
                    self._handles.append(param.register_hook(self._reset_observer(param)))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._applied.clear()

    def _record_applied(self, optimizer: Optimizer, args: object, kwargs: object) -> None:
        for param in _parameters(optimizer):
            if param.grad is None:
                self._applied.pop(param, None)
            else:
                self._applied[param] = weakref.ref(param.grad)

    def _reset_observer(self, param: Tensor) -> Callable[[Tensor], None]:
        def observe(grad: Tensor) -> None:
            if param in self._applied and (param.grad is None or not param.grad.any()):
                del self._applied[param]

        return observe

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        params = [p for p in _parameters(optimizer) if p.grad is not None]
        carried = [
            p for p in params
            if (ref := self._applied.get(p)) is not None and ref() is p.grad and bool(p.grad.any())
        ]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        nonfinite = [] if scaler is not None else _nonfinite(params)
        problems = []
        if carried:
            problems.append(
                f"the gradients of {self._describe(carried)} were not reset since the previous "
                "optimizer step: .grad accumulates across backward calls, so this step applies "
                "the previous step's gradient again. In manual optimization call "
                "optimizer.zero_grad() once per step, before backward; in automatic optimization "
                "Lightning does it unless optimizer_zero_grad is overridden."
            )
        if nonfinite:
            problems.append(
                f"non-finite gradients (NaN or Inf) in {self._describe(nonfinite)} after "
                "backward. Look for log(0), 0/0 or an exploding penalty: lower the learning rate "
                "or the penalty weight, or run Trainer(detect_anomaly=True) to find the operation."
            )
        if problems:
            self._act(" Also ".join(problems), params)

    def _describe(self, params: list[Tensor]) -> str:
        names = [self._names.get(p, f"a parameter of shape {list(p.shape)}") for p in params]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return ", ".join(names[:3]) + more

    def _act(self, message: str, params: list[Tensor]) -> None:
        message = f"AccumulationGuard: {message}"
        if self.action == "raise":
            raise GradientError(message)
        if self.action == "skip":
            for param in params:
                param.grad = None
            message += " (action='skip': the gradients were dropped, this step changes nothing.)"
        rank_zero_warn(message)
