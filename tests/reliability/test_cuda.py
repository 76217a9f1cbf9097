"""The penalties on a CUDA device with its default settings (cuDNN convolutions in TF32), under
bf16 autocast and fp16 with a real GradScaler, and the app's default job on a GPU.

Marked ``cuda``: skipped without a device (CI has none); run on a GPU machine with
``python -m pytest -m cuda``. References are float64 computations on the CPU on the same points.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from penalty_cases import (
    PRESETS,
    batch,
    penalty,
    penalty_under,
    penalty_value,
    per_sample_losses,
    tiny_model,
    train_with_grad_scaler,
)
from torch import Tensor, nn

from gradreg import GradientError
from gradreg.penalties import as_points, interpolate, make_penalty, perturb_dragan
from tests.residual_net import ResidualNet

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parents[2]
# presets whose points and draws can be made on the CPU and moved (path length, the perturbation
# estimate, the spectral norm's power iteration and the Hessian penalty draw on the device: covered
# under autocast below); the Jacobian with all K=2 directions is exact
ORACLE_PRESETS = [name for name in PRESETS
                  if name not in ("path_length", "approx_r1", "approx_r2", "spectral", "hessian")]
#: Presets that difference two forwards: refused under bf16 autocast (as on the CPU,
#: tests/reliability/test_precision.py).
DIFFERENCING = ("approx_r1", "approx_r2", "hessian")


def flat_grads(value: Tensor, model: nn.Module) -> Tensor:
    params = list(model.parameters())
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten().double().cpu()
                      for p, g in zip(params, grads, strict=True)])


def evaluate(name: str, model: nn.Module, device: torch.device, dtype: torch.dtype,
             **overrides: object) -> tuple[float, Tensor]:
    """Value and parameter gradient of the preset on ``model`` moved to ``device``/``dtype``,
    at points made on the CPU in float64 (same draws everywhere) and then moved."""
    model = copy.deepcopy(model).to(device, dtype)
    gp = penalty(name, **({"count": 2} if name == "jacobian" else {}), **overrides)
    x = batch(0).double()
    if gp.config.points in ("parameters", "activations"):
        value = penalty_value(gp, model, x.to(device, dtype))
    else:
        torch.manual_seed(0)
        cpu_points = {"fake": lambda r: r + 0.5,
                      "interpolates": lambda r: interpolate(r, r.flip(0) + 0.5),
                      "perturbed": perturb_dragan}.get(gp.config.points, lambda r: r)(x)
        points = as_points(cpu_points.detach().to(device, dtype))
        outputs = model(points)
        value = gp(per_sample_losses(outputs) if gp.config.of == "loss" else outputs, points)
    return value.item(), flat_grads(value, model)


def conv_critic(activation: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 4, 2, 1), activation(), nn.Conv2d(16, 32, 4, 2, 1),
                         activation(), nn.Flatten(), nn.Linear(32 * 4 * 4, 1), nn.Flatten(0))


def relative_error(estimate: Tensor, exact: Tensor) -> float:
    return float((estimate - exact).norm() / exact.norm())


@pytest.mark.parametrize("name", ORACLE_PRESETS)
def test_every_preset_on_cuda_float32_matches_float64(name: str) -> None:
    """A tanh MLP (float32 matmuls stay float32 by torch's default): value and parameter
    gradient within 1e-4 of the float64 CPU computation."""
    value, grads = evaluate(name, tiny_model(), CUDA, torch.float32)
    value64, grads64 = evaluate(name, tiny_model(), torch.device("cpu"), torch.float64)
    assert value == pytest.approx(value64, rel=1e-4, abs=1e-7)
    torch.testing.assert_close(grads, grads64, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["wgan_gp", "r1"])
def test_conv_critic_penalties_in_tf32_are_within_its_rounding(name: str) -> None:
    """cuDNN's default TF32 convolutions: the exact penalty's value and gradient within 1e-2 of
    float64 (TF32 keeps 10 mantissa bits: ~5e-4 per rounding)."""
    assert torch.backends.cudnn.allow_tf32
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    results = []
    for device, dtype in ((CUDA, torch.float32), (torch.device("cpu"), torch.float64)):
        critic = conv_critic().to(device, dtype)
        torch.manual_seed(0)
        cpu_points = interpolate(x, x.flip(0)) if name == "wgan_gp" else x
        points = as_points(cpu_points.detach().to(device, dtype))
        value = make_penalty(name)(critic(points), points)
        results.append((value.item(), flat_grads(value, critic)))
    (value, grads), (value64, grads64) = results
    assert value == pytest.approx(value64, rel=1e-2)
    assert relative_error(grads, grads64) < 1e-2


@pytest.mark.parametrize("name", [name for name in PRESETS if name not in DIFFERENCING])
def test_bf16_autocast_on_cuda_is_finite_and_close_to_fp32(name: str) -> None:
    """gr by its recipe's step (its default step refuses bf16, as on the CPU)."""
    model = tiny_model().to(CUDA)
    options = {"step": 1e-3} if name == "gr" else {}
    bf16, fp32 = (penalty_under(dtype, penalty(name, **options), model, 0)
                  for dtype in (torch.bfloat16, None))
    assert math.isfinite(bf16)
    assert abs(bf16 - fp32) <= 0.15 * abs(fp32) + 1e-5, (bf16, fp32)


@pytest.mark.parametrize("name", DIFFERENCING)
def test_bf16_autocast_on_cuda_refuses_difference_quotients(name: str) -> None:
    """As on the CPU: bf16 rounding would swamp the difference; float32 runs."""
    model = tiny_model().to(CUDA)
    with pytest.raises(GradientError, match=r"unit roundoff 3\.9e-03"):
        penalty_under(torch.bfloat16, penalty(name), model, 0)
    assert math.isfinite(penalty_under(None, penalty(name), model, 0))


def test_fp16_with_a_grad_scaler_on_cuda() -> None:
    """WGAN-GP under fp16 autocast with ``torch.amp.GradScaler``: the overflowing first steps are
    skipped and the scale lowered; the penalty at the start equals fp32's to 2%; training ends
    finite."""
    torch.manual_seed(0)
    critic = tiny_model()[:2].append(nn.Linear(16, 1)).to(CUDA)
    x = batch(0, size=8).to(CUDA)
    points = interpolate(x, x.flip(0) + 0.5)
    fp32 = make_penalty("wgan_gp")(critic(points), points)
    with torch.autocast("cuda", dtype=torch.float16):
        fp16 = make_penalty("wgan_gp")(critic(points), points, loss_scale=2.0**10)
    assert fp16.item() == pytest.approx(fp32.item(), rel=2e-2)
    scaler, gp = train_with_grad_scaler(critic)
    assert scaler.get_scale() < 2.0**16
    assert torch.isfinite(gp.last_value)
    assert all(torch.isfinite(p).all() for p in critic.parameters())


@pytest.mark.parametrize(("model", "bound"), [
    (lambda: conv_critic(nn.Tanh), 6e-2),  # TF32 convolutions: step 0.5
    (lambda: tiny_model()[:2].append(nn.Linear(16, 1)).append(nn.Flatten(0)), 1e-3),  # float32
], ids=["conv_critic_tf32", "mlp_float32"])
def test_finite_difference_error_within_its_documented_bound(model: object,
                                                             bound: float) -> None:
    critic = model()
    shape = (8, 3, 16, 16) if isinstance(critic[0], nn.Conv2d) else (8, 4)
    x = torch.randn(shape, dtype=torch.float64)
    torch.manual_seed(0)
    cpu_points = interpolate(x, x.flip(0))
    exact64 = copy.deepcopy(critic).double()
    p64 = as_points(cpu_points)
    exact = flat_grads(make_penalty("wgan_gp")(exact64(p64), p64), exact64)
    critic = critic.to(CUDA)
    points = as_points(cpu_points.detach().to(CUDA, torch.float32))
    penalty = make_penalty("wgan_gp", method="finite_difference")
    estimate = flat_grads(penalty(critic, points), critic)
    assert relative_error(estimate, exact) < bound


def test_chunks_on_a_batchnorm_resnet() -> None:
    """A ResNet-like model with BatchNorm (eval mode: samples independent): chunks=4 gives the
    unchunked parameter gradient."""
    model = ResidualNet(nn.Tanh, channels=8, blocks=2).to(CUDA).eval()
    x = torch.randn(16, 1, 8, 8, device=CUDA)

    def scores(q: Tensor) -> Tensor:
        return model(q)[:, 0]

    grads = []
    for chunks in (1, 4):
        points = as_points(x)
        value = make_penalty("r1", chunks=chunks)(scores if chunks > 1 else scores(points), points)
        grads.append(flat_grads(value, model))
    assert relative_error(grads[1], grads[0]) < 1e-3


def test_check_finite_needs_no_host_sync() -> None:
    """With torch's sync debug mode set to raise, penalty calls (check_finite on) go through;
    a NaN is reported once its asynchronous copy is read (``settle`` waits for it)."""
    model = tiny_model().to(CUDA)
    gp = make_penalty("wgan_gp")
    x = batch(0).to(CUDA)
    penalty_value(gp, model, x)  # the first call's one-off checks
    # made before: a pageable host copy and a Python scalar written into a device tensor
    # synchronize
    batches = [batch(step).to(CUDA) for step in range(3)]
    x_nan = x.clone()
    x_nan[0, 0] = float("nan")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step_batch in batches:
            penalty_value(gp, model, step_batch)
        with pytest.raises(GradientError, match=r"points of call 5 contain NaN or Inf"):
            penalty_value(gp, model, x_nan)  # reported here where its copy has landed already
            torch.cuda.set_sync_debug_mode("default")
            gp.finite_check.settle()  # else once settle has waited for it
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_app_default_job_on_a_gpu(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "trainer=gpu", "debug=fast_dev_run",
         f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, text=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test/acc " in result.stdout and "train/penalty/double_backprop" in result.stdout
