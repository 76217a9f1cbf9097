"""Every preset on one tiny model, evaluated where its ``points`` say (shared by the tests here).

The model ``4 -> 16 -> tanh -> 2`` plays every role (classifier, critic, generator): the penalty
mechanism does not care which. The task loss is a regression to a fixed target, so a plain SGD run
stays bounded and any NaN comes from the penalty, not from divergence.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from gradreg import capture
from gradreg.penalties import (
    PRESETS,
    GradientPenalty,
    as_points,
    interpolate,
    make_penalty,
    perturb_dragan,
)
from gradreg.penalties.methods.param_gradient import LossAt

FEATURES, HIDDEN, OUTPUTS = 4, 16, 2
# options a preset needs on this model (the submodule whose output "intermediate" penalizes)
OVERRIDES: dict[str, dict] = {"intermediate": {"layers": ["1"]}}


def tiny_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS))


def penalty(name: str, **overrides: object) -> GradientPenalty:
    """The preset ``name`` ready for :func:`tiny_model`."""
    return make_penalty(name, **{**OVERRIDES.get(name, {}), **overrides})


def batch(step: int, size: int = 16) -> Tensor:
    """A deterministic batch for ``step``: the data never depends on the global RNG."""
    return torch.randn(size, FEATURES, generator=torch.Generator().manual_seed(step))


def per_sample_losses(outputs: Tensor) -> Tensor:
    """The task's loss of each sample, ``[B]``."""
    return (outputs - 1.0).square().mean(1)


def task_loss(model: nn.Module, x: Tensor) -> Tensor:
    return per_sample_losses(model(x)).mean()


def penalty_value(gp: GradientPenalty, model: nn.Module, x: Tensor, **options: object) -> Tensor:
    """``gp`` evaluated on ``model`` at the points its ``points`` names, made from batch ``x``,
    of the model's outputs, or of the per-sample losses for a penalty of losses (``of="loss"``);
    ``options`` go to ``gp.forward`` (``loss_scale``)."""
    of = per_sample_losses if gp.config.of == "loss" else (lambda outputs: outputs)
    if gp.config.points == "parameters" and gp.config.method.name == "finite_difference":
        loss = task_loss(model, x)  # the GNP form: the loss as a closure, its value shared
        return gp(LossAt(lambda: task_loss(model, x), loss), list(model.parameters()), **options)
    if gp.config.points == "parameters":
        return gp(task_loss(model, x), list(model.parameters()), **options)
    if gp.config.points == "activations":
        with capture(model, *gp.config.layers) as activations:
            outputs = of(model(x))
        return gp(outputs, [activations[layer] for layer in gp.config.layers], **options)
    make_points = {
        "inputs": as_points, "real": as_points, "latents": as_points,
        "fake": lambda real: as_points(real + 0.5),
        "interpolates": lambda real: interpolate(real, real.flip(0) + 0.5),
        "perturbed": perturb_dragan,
    }[gp.config.points]
    points = make_points(x)
    if not gp.needs_callable:
        return gp(of(model(points)), points, **options)
    return gp(model if gp.config.of != "loss" else lambda q: of(model(q)), points, **options)


def penalty_under(dtype: torch.dtype | None, gp: GradientPenalty, model: nn.Module,
                  step: int) -> float:
    """The unweighted penalty at ``step`` on a copy of ``gp`` (its EMA/counters untouched), under
    autocast to ``dtype`` on the model's device (None: no autocast), on ``batch(step)`` moved
    there, with the random draws (interpolation, projections) seeded by ``step``."""
    gp = copy.deepcopy(gp)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        torch.manual_seed(step)
        penalty_value(gp, model, batch(step).to(device))
    return gp.last_value.float().item()


def sgd_step(gp: GradientPenalty, model: nn.Module, x: Tensor, *, lr: float = 1e-2,
             dtype: torch.dtype | None = None) -> Tensor:
    """One SGD step on ``task loss + penalty``; returns the detached unweighted penalty.

    ``dtype``: run the forward pass and the penalty under ``torch.autocast("cpu", dtype)`` (as a
    Lightning ``training_step`` under ``precision="bf16-mixed"``), the backward outside it.
    """
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        total = task_loss(model, x) + penalty_value(gp, model, x)
    model.zero_grad(set_to_none=True)
    total.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= lr * parameter.grad
    return gp.last_value


def train_with_grad_scaler(model: nn.Module, *, check_finite: bool = True,
                           steps: int = 8) -> tuple[torch.amp.GradScaler, GradientPenalty]:
    """``steps`` SGD steps of a critic loss plus WGAN-GP under fp16 autocast with a real
    ``torch.amp.GradScaler`` on the model's device, the penalty given ``loss_scale``; returns
    the scaler and the penalty. The scaler starts at 2**16, above fp16's maximum, so the first
    steps overflow and are skipped."""
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device.type)
    gp = make_penalty("wgan_gp", check_finite=check_finite)
    for step in range(steps):
        x = batch(step, size=8).to(device)
        points = as_points(x)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(x).float().mean() + gp(model(points), points,
                                                loss_scale=scaler.get_scale())
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return scaler, gp


__all__ = ["PRESETS", "batch", "penalty", "penalty_under", "penalty_value", "sgd_step", "task_loss",
           "tiny_model", "train_with_grad_scaler"]
