r"""Mixed precision: bf16 autocast with every preset, and PyTorch's GradScaler recipe for fp16.

The recipe (torch.amp docs, "Gradient penalty"): differentiate ``outputs * s`` and multiply the
gradients by :math:`1/s`; never ``scaler.unscale_`` them. Mathematically
:math:`\tfrac1s \nabla(s f) = \nabla f`, so in fp32/fp64 the value and its parameter gradient are
those of the unscaled computation; in fp16 the scaled gradients stay above the underflow limit.
"""

from __future__ import annotations

import math

import pytest
import torch
from penalty_cases import (
    PRESETS,
    batch,
    penalty,
    penalty_under,
    penalty_value,
    sgd_step,
    tiny_model,
    train_with_grad_scaler,
)
from torch import nn

from gradreg import GradientError
from gradreg.penalties import as_points, make_penalty

BF16_STEPS, BF16_CHECK_EVERY = 1000, 100
# |P_bf16 - P_fp32| <= BF16_RTOL * |P_fp32| + BF16_ATOL, same parameters, batch and random draws.
# Measured over the 10 checks of each preset's 1,000-step run: at most 8.4% (param_grad_norm),
# 1-6% for the others; the absolute floor covers penalties trained down to ~1e-6, below bf16's
# resolution of the initial penalty.
BF16_RTOL, BF16_ATOL = 0.15, 1e-5
#: Presets that difference two forwards (the perturbation estimate, the Hessian penalty's second
#: difference): bf16 rounding moves their quotients by up to 2u/σ = 0.78 (σ = 0.01) and
#: 4u/ε² = 1.6 (ε = 0.1) of the outputs' size, so bf16 autocast is refused (measured for the
#: perturbation estimate in docs/benchmarks.md: errors of 0.9-1.3 at σ = 0.01).
DIFFERENCING = {"approx_r1": "0.78", "approx_r2": "0.78", "hessian": "1.6"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in PRESETS if name not in DIFFERENCING])
def test_bf16_autocast_1000_steps_finite_and_close_to_fp32(name: str) -> None:
    """1,000 SGD steps under ``autocast(bfloat16)`` (``precision="bf16-mixed"``), batch 16: every
    penalty finite (check_finite would raise), and every 100 steps within tolerance of fp32."""
    # gr's default step refuses bf16 (test_gr_default_step_refuses_bf16); its recipe's step runs
    model, gp = tiny_model(), penalty(name, **({"step": 1e-3} if name == "gr" else {}))
    for step in range(BF16_STEPS):
        if step % BF16_CHECK_EVERY == 0:
            bf16 = penalty_under(torch.bfloat16, gp, model, step)
            fp32 = penalty_under(None, gp, model, step)
            assert abs(bf16 - fp32) <= BF16_RTOL * abs(fp32) + BF16_ATOL, (step, bf16, fp32)
        sgd_step(gp, model, batch(step), dtype=torch.bfloat16)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(("name", "rounding"), DIFFERENCING.items())
def test_bf16_autocast_refuses_difference_quotients(name: str, rounding: str) -> None:
    """bf16 (u = 2**-8) is refused with the predicted rounding error and the way out; the same
    penalty runs in float32, and the Hessian penalty's exact method runs in bf16."""
    model, gp = tiny_model(), penalty(name)
    with pytest.raises(GradientError, match=rf"unit roundoff 3\.9e-03 .* rounding error of up to "
                                            rf"{rounding} of the outputs. size .* float32"):
        penalty_under(torch.bfloat16, gp, model, 0)
    assert math.isfinite(penalty_under(None, gp, model, 0))
    if name == "hessian":
        exact = penalty(name, method="double_backward")
        assert math.isfinite(penalty_under(torch.bfloat16, exact, model, 0))


def test_gr_default_step_refuses_bf16() -> None:
    """GR's default ε is a float32 step: under bf16 autocast the difference of gradients is
    rounding noise, refused naming the fixes (float32, an explicit step, double backward)."""
    with pytest.raises(GradientError, match=r"unit roundoff 3\.9e-03 .*\(LossAt\.run and the "
                                            r"penalty outside autocast\), pass step"):
        penalty_under(torch.bfloat16, penalty("gr"), tiny_model(), 0)


class StubScaler:
    """What the penalty needs of ``torch.amp.GradScaler``: ``get_scale()``."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def get_scale(self) -> float:
        return self.scale


@pytest.mark.parametrize("name", ["wgan_gp", "r1", "jacobian", "path_length", "derivative",
                                  "param_grad_norm", "intermediate"])
def test_loss_scale_gives_the_unscaled_value_and_parameter_gradient(name: str) -> None:
    """fp64, scale 2**16: value and d(value)/d(parameters) equal the unscaled ones to 1e-12."""
    model = tiny_model().double()
    results = []
    for scaler in (None, StubScaler(2.0**16)):
        gp = penalty(name)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            value = penalty_value(gp, model, batch(0).double(), **(
                {} if scaler is None else {"loss_scale": scaler.get_scale()}))
        # the last bias has no effect on input gradients: its gradient is None (unused)
        grads = torch.autograd.grad(value, list(model.parameters()), allow_unused=True)
        results.append((value, [torch.zeros(()) if g is None else g for g in grads]))
    (plain, plain_grads), (scaled, scaled_grads) = results
    torch.testing.assert_close(scaled, plain, rtol=1e-12, atol=0)
    for s, p in zip(scaled_grads, plain_grads, strict=True):
        torch.testing.assert_close(s, p, rtol=1e-12, atol=1e-15)


def small_gradient_critic() -> nn.Sequential:
    """A critic whose input gradients are ~1e-9 (weights scaled by 1e-4): below fp16's smallest
    subnormal (6e-8) unless the backward pass runs on scaled values."""
    model = tiny_model()[:2].append(nn.Linear(16, 1))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1e-4)
    return model


def test_loss_scale_prevents_fp16_underflow() -> None:
    """R1 under ``autocast(float16)``: 0 without a scale (the gradient underflows), the fp32
    value to 2% with scale 2**14 (the fp16 weights themselves are rounded to ~0.5%)."""
    model, x = small_gradient_critic(), batch(0, size=8)

    def r1(dtype: torch.dtype | None, scale: float | None) -> float:
        points = as_points(x)
        with torch.autocast("cpu", dtype=torch.float16, enabled=dtype is not None):
            return make_penalty("r1")(model(points), points, loss_scale=scale).item()

    fp32 = r1(None, None)
    assert 1e-18 < fp32 < 1e-15
    assert r1(torch.float16, None) == 0.0
    assert r1(torch.float16, 2.0**14) == pytest.approx(fp32, rel=2e-2)


@pytest.mark.parametrize("check_finite", [False, True],
                         ids=["check_finite=False", "check_finite=True"])
def test_grad_scaler_absorbs_fp16_overflow(check_finite: bool) -> None:
    """WGAN-GP with ``torch.amp.GradScaler`` (init scale 2**16 > fp16's max 65504): the first
    steps overflow, the scaler skips them and halves its scale, then training proceeds with
    finite penalties and parameters."""
    torch.manual_seed(0)
    model = tiny_model()[:2].append(nn.Linear(16, 1))
    scaler, gp = train_with_grad_scaler(model, check_finite=check_finite)
    assert scaler.get_scale() < 2.0**16
    assert torch.isfinite(gp.last_value)
    assert all(torch.isfinite(p).all() for p in model.parameters())
