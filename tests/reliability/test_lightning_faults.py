"""Faults seen through a Lightning module: an op without double backward, and fp16 loss scaling."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from lightning_cases import QUIET, classifier, toy
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils.data import DataLoader

from gradreg import GradientError
from gradreg.lightning.classifier import Classifier
from gradreg.lightning.precision import loss_scale
from gradreg.penalties import GradientPenalty, make_penalty


class OnceDifferentiableTanh(torch.autograd.Function):
    """tanh with a hand-written backward that cannot itself be differentiated."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y = x.tanh()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class Tanh(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return OnceDifferentiableTanh.apply(x)


def fit(model: L.LightningModule, **trainer_options: object) -> L.Trainer:
    trainer = L.Trainer(**QUIET, max_steps=2, enable_checkpointing=False, **trainer_options)
    trainer.fit(model, DataLoader(toy("moons", 64), batch_size=16))
    return trainer


def test_op_without_double_backward_is_named_with_the_alternatives() -> None:
    """Caught on the first training step, before any backward, with the op and both fixes."""
    backbone = nn.Sequential(nn.Linear(2, 8), Tanh(), nn.Linear(8, 2))
    model = Classifier(backbone, {"db": make_penalty("double_backprop")})
    with pytest.raises(GradientError) as error:
        fit(model)
    message = str(error.value)
    assert "op without a double backward" in message and "once_differentiable" in message
    assert "method='finite_difference'" in message and "replace the op" in message


def test_loss_scale_is_none_without_a_scaler() -> None:
    assert loss_scale(None) is None
    assert loss_scale(L.Trainer(**QUIET)) is None  # fp32
    assert loss_scale(L.Trainer(**QUIET, precision="bf16-mixed")) is None


def test_classifier_passes_the_grad_scalers_scale_to_its_penalties(monkeypatch) -> None:
    """``precision="16-mixed"`` with a GradScaler (given explicitly: Lightning maps 16-mixed on
    CPU to bf16): every penalty call gets ``loss_scale=scaler.get_scale()`` (2**16)."""
    seen: list[object] = []
    forward = GradientPenalty.forward

    def recording(self, outputs, inputs, **options):
        seen.append(options.get("loss_scale"))
        return forward(self, outputs, inputs, **options)

    monkeypatch.setattr(GradientPenalty, "forward", recording)
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    fit(classifier(db={"name": "double_backprop"}), plugins=[plugin])
    assert seen == [2.0**16, 2.0**16]
