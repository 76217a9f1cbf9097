"""The loss scale a penalty needs under fp16 mixed precision (``precision="16-mixed"``).

PyTorch's gradient-penalty recipe for a ``GradScaler``: differentiate ``outputs * s`` and multiply
the gradients by ``1/s`` (``GradientPenalty.forward(..., loss_scale=s)``), so that small fp16
gradients do not underflow; never ``scaler.unscale_`` them. Lightning keeps the scaler on its
precision plugin (``trainer.precision_plugin.scaler``); bf16 and fp32 have none.
"""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["loss_scale"]


def loss_scale(trainer: pl.Trainer | None) -> float | None:
    """The current scale of ``trainer``'s enabled ``GradScaler``; ``None`` without one (or without
    a trainer), which ``GradientPenalty.forward`` takes as "no scaling"."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler.get_scale()
