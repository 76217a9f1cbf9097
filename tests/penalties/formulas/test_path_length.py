"""Path length as StyleGAN2 computes it (W+ latents), its running mean's precision, and random
projections that do not depend on the autocast dtype."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import grad

from gradreg import NonFiniteError
from gradreg.penalties import (
    as_points,
    jacobian,
    path_length,
)
from gradreg.penalties.formulas.projections import latent_length, latent_sq_length

B, NUM_WS, W_DIM, SIDE = 3, 4, 5, 4


class WPlusGenerator(nn.Module):
    """[B, num_ws, w_dim] -> [B, 1, side, side]: each layer's w enters through its own weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(W_DIM, SIDE * SIDE) for _ in range(NUM_WS))

    def forward(self, ws: Tensor) -> Tensor:
        h = sum(torch.tanh(layer(ws[:, i])) for i, layer in enumerate(self.layers))
        return h.view(-1, 1, SIDE, SIDE)


def stylegan2_pl(generator: nn.Module, ws: Tensor, pl_mean: float,
                 seed: int) -> tuple[Tensor, Tensor]:
    """stylegan2-ada-pytorch training/loss.py, Gpl phase, pl_weight 2, pl_decay 0.01, gain 1:
    the penalty and the updated pl_mean."""
    ws = ws.detach().requires_grad_()
    img = generator(ws)
    torch.manual_seed(seed)
    pl_noise = torch.randn_like(img) / math.sqrt(img.shape[2] * img.shape[3])
    (pl_grads,) = grad((img * pl_noise).sum(), ws, create_graph=True)
    pl_lengths = pl_grads.square().sum(2).mean(1).sqrt()
    mean = torch.tensor(pl_mean, dtype=ws.dtype).lerp(pl_lengths.mean(), 0.01)
    return (pl_lengths - mean).square().mean() * 2.0, mean.detach()


def test_w_plus_path_length_is_stylegan2s_in_value_and_gradient() -> None:
    """Value and parameter gradient equal StyleGAN2's formula (norm over w_dim, mean over
    num_ws), not num_ws times it (the norm over both dims)."""
    generator = WPlusGenerator().double()
    torch.manual_seed(1)
    ws = torch.randn(B, NUM_WS, W_DIM, dtype=torch.float64)
    expected, pl_mean = stylegan2_pl(generator, ws, 0.0, seed=7)
    expected_grads = grad(expected, list(generator.parameters()))
    penalty, points = path_length(), ws.detach().requires_grad_()
    images = generator(points)
    torch.manual_seed(7)
    value = penalty(images, points)
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=0)
    for got, want in zip(grad(value, list(generator.parameters())), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    assert penalty.ema.item() == pytest.approx(pl_mean.item(), rel=1e-12)


def test_float64_running_mean_has_no_float32_drift() -> None:
    """50 updates in float64 equal the float64 recurrence to 1e-15 (a float32 buffer is off by
    ~1e-8 relative), and a state dict restores it in float64."""
    penalty = path_length()
    expected = torch.zeros((), dtype=torch.float64)
    for step in range(50):
        norms = torch.rand(8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        penalty._running_mean.update(norms)
        expected = expected + 0.01 * (norms.mean() - expected)
    assert penalty.ema.dtype == torch.float64
    assert penalty.ema.item() == pytest.approx(expected.item(), rel=1e-15)
    restored = path_length()
    restored.load_state_dict(penalty.state_dict())
    assert restored.ema.dtype == torch.float64 and restored.ema.item() == penalty.ema.item()


def test_the_running_mean_updates_the_registered_buffer_after_it_is_replaced() -> None:
    """module.double() and load_state_dict(assign=True) put another tensor in the ``ema``
    buffer; the updates go to that one: 0 + 0.01 * (1 - 0), then 0.5 + 0.01 * (1 - 0.5)."""
    penalty = path_length().double()
    penalty._running_mean.update(torch.ones(4, dtype=torch.float64))
    assert penalty.ema.dtype == torch.float64 and penalty.ema.item() == pytest.approx(0.01)
    saved = {**penalty.state_dict(), "ema": torch.tensor(0.5, dtype=torch.float64)}
    penalty.load_state_dict(saved, assign=True)
    penalty._running_mean.update(torch.ones(4, dtype=torch.float64))
    assert penalty.state_dict()["ema"].item() == pytest.approx(0.505)


def test_bf16_norms_update_a_float32_running_mean() -> None:
    """Norms of 1 in bf16: after 300 updates the mean is 1 - 0.99**300 = 0.951 (float32
    arithmetic); updated in bf16 it would stall where 0.01 * (1 - a) falls below bf16's spacing."""
    penalty = path_length()
    for _ in range(300):
        penalty._running_mean.update(torch.ones(4, dtype=torch.bfloat16))
    assert penalty.ema.dtype == torch.float32
    assert penalty.ema.item() == pytest.approx(1 - 0.99**300, rel=1e-5)


def test_the_running_mean_follows_the_norms_to_their_device() -> None:
    """A penalty left on the CPU while the model runs elsewhere: its buffer moves to the norms'
    device at the first update (the meta device stands in for a GPU), in float32, as the
    module's registered buffer."""
    penalty = path_length()
    penalty._running_mean.update(torch.ones(4, device="meta"))
    assert penalty.ema.device.type == "meta" and penalty.ema.dtype == torch.float32
    assert dict(penalty.named_buffers())["ema"] is penalty.ema


@pytest.mark.parametrize("make", [jacobian, path_length], ids=["jacobian", "path_length"])
def test_random_projections_do_not_depend_on_the_autocast_dtype(make: object) -> None:
    """A linear map under bf16 autocast: the same seed gives the float32 run's directions, so the
    values agree to bf16 rounding (2%); different draws (torch 2.11's bf16 randn) differ by O(1)."""
    torch.manual_seed(0)
    model = nn.Linear(6, 8)
    x = torch.randn(16, 6)
    values = []
    for enabled in (False, True):
        points = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            torch.manual_seed(3)
            values.append(make(weight=1.0)(model(points), points).float().item())
    assert values[1] == pytest.approx(values[0], rel=2e-2)


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(),
                                  lambda m: m.bfloat16()], ids=["to_bf16", "half", "bfloat16"])
def test_a_module_cast_to_half_precision_keeps_a_float32_running_mean(cast) -> None:
    """module.to(torch.bfloat16) (Lightning's precision="bf16-true") cast the buffer to bf16,
    whose updates of 0.01 * (1.5 - a) round away: after 400 steps it stalled near 1.17. In
    float32 the mean of norms of 1.5 after 400 steps is 1.5 (1 - 0.99**400) = 1.47307, and a cast
    in the middle of the run keeps the mean as it was (not rounded to bf16)."""
    penalty = cast(path_length())
    assert penalty.ema.dtype == torch.float32
    for step in range(400):
        if step == 200:
            before = penalty.ema.item()
            penalty = cast(penalty)
            assert penalty.ema.dtype == torch.float32 and penalty.ema.item() == before
        penalty._running_mean.update(torch.full((4,), 1.5, dtype=torch.bfloat16))
    assert penalty.ema.dtype == torch.float32
    assert penalty.ema.item() == pytest.approx(1.5 * (1 - 0.99**400), rel=1e-5)


def test_path_length_of_a_bf16_generator_is_that_of_a_float32_penalty() -> None:
    """The whole call on a bf16 generator: a penalty cast to bf16 gives the running mean and the
    value of one that was never cast (float32 buffer), bit for bit, over 5 steps."""
    generator = WPlusGenerator().to(torch.bfloat16)
    ws = torch.randn(B, NUM_WS, W_DIM, dtype=torch.bfloat16)
    results = []
    for penalty in (path_length(), path_length().to(torch.bfloat16)):
        torch.manual_seed(1)
        values = [penalty(generator, ws.clone().requires_grad_()).item() for _ in range(5)]
        results.append((values, penalty.ema.dtype, penalty.ema.item()))
    assert results[0] == results[1]
    assert results[1][1] == torch.float32 and results[1][2] > 0


def generator() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()


def pl_call(penalty: nn.Module, g: nn.Module, w: Tensor, seed: int) -> Tensor:
    torch.manual_seed(seed)  # the same projection noise for both penalties
    w = as_points(w)
    return penalty(g(w), w)


@pytest.mark.parametrize("check_finite", [True, False])
def test_a_nan_batch_leaves_the_path_length_mean_as_it_was(check_finite: bool) -> None:
    """A NaN batch between clean ones: the running mean and the later values are those of a
    penalty that never saw it (bitwise), and the checkpointed mean is finite."""
    g = generator()
    clean = [torch.randn(4, 3, dtype=torch.float64) for _ in range(3)]
    bad = clean[0].clone()
    bad[1, 0] = float("nan")
    penalty = path_length(check_finite=check_finite)
    oracle = path_length()
    pl_call(penalty, g, clean[0], 0)
    pl_call(oracle, g, clean[0], 0)
    before = penalty.ema.clone()
    if check_finite:
        with pytest.raises(NonFiniteError, match="points of call 2"):
            pl_call(penalty, g, bad, 1)
    else:
        assert torch.isnan(pl_call(penalty, g, bad, 1))
    assert torch.equal(penalty.ema, before)
    for seed, w in enumerate(clean[1:], start=2):
        value, expected = pl_call(penalty, g, w, seed), pl_call(oracle, g, w, seed)
        assert torch.isfinite(value) and torch.equal(value, expected)
    assert torch.equal(penalty.ema, oracle.ema) and penalty.ema.item() != 0.0
    assert torch.isfinite(penalty.state_dict()["ema"])


def test_the_latent_length_is_the_root_of_the_squared_one_with_gradient_zero_at_zero() -> None:
    """W+ and plain latents together (float64): the length equals sqrt(latent_sq_length), its
    gradient equals that of the root away from 0, and a sample whose gradient vanishes has
    length 0 and gradient 0 (the root's would be NaN), second order included."""
    torch.manual_seed(0)
    w_plus = torch.randn(3, NUM_WS, W_DIM, dtype=torch.float64)
    plain = torch.randn(3, W_DIM, dtype=torch.float64)
    w_plus[1], plain[1] = 0.0, 0.0
    grads = (w_plus.requires_grad_(), plain.requires_grad_())
    length, sq = latent_length(grads), latent_sq_length(grads)
    torch.testing.assert_close(length, sq.sqrt(), rtol=1e-14, atol=0)
    assert length[1] == 0
    weights = torch.tensor([0.3, 0.7, -1.1], dtype=torch.float64)
    ours = grad((length * weights).sum(), grads, create_graph=True)
    root = grad((sq[[0, 2]].sqrt() * weights[[0, 2]]).sum(), grads)
    for got, want in zip(ours, root, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
        assert torch.all(got[1] == 0)
    second = grad(sum(g.square().sum() for g in ours), grads)
    assert all(torch.isfinite(s).all() for s in second)
