"""Every preset against independent oracles: gradcheck in float64 and straight-line formulas."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import grad

from gradreg.penalties import PRESETS, asam, make_penalty, sam
from gradreg.penalties.call import PenaltyFunctions
from gradreg.penalties.methods.param_gradient import LossAt

from .conftest import ALL_PRESETS, CATALOGUE_PRESETS, preset_case, preset_kwargs


def params_of(model: torch.nn.Module) -> tuple[list[str], tuple[Tensor, ...]]:
    names = [n for n, _ in model.named_parameters()]
    return names, tuple(p.detach().clone().requires_grad_() for p in model.parameters())


def test_catalogue_is_complete() -> None:
    assert set(PRESETS) == {*ALL_PRESETS, *CATALOGUE_PRESETS}


def test_gradcheck_parameters_to_penalty(preset: str) -> None:
    """d penalty / d parameters through the double-backward path equals finite differences."""
    model, run = preset_case(preset)
    names, params = params_of(model)

    def penalty_of(*values: Tensor) -> Tensor:
        penalty = make_penalty(preset, **preset_kwargs(preset))  # fresh state (path-length EMA)
        return run(penalty, model, dict(zip(names, values, strict=True)))

    assert penalty_of(*params).item() > 0
    assert torch.autograd.gradcheck(penalty_of, params, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("preset", ["r1", "wgan_gp", "double_backprop", "path_length"])
def test_gradgradcheck_parameters_to_penalty(preset: str) -> None:
    model, run = preset_case(preset)
    names, params = params_of(model)

    def penalty_of(*values: Tensor) -> Tensor:
        return run(make_penalty(preset), model, dict(zip(names, values, strict=True)))

    assert torch.autograd.gradgradcheck(penalty_of, params, eps=1e-6, atol=1e-5, rtol=1e-3)


# Straight-line reference implementations: torch.autograd.grad and the published formulas, no
# gradreg code. Random draws replay the closure's order after torch.manual_seed(1).
def _norms(outputs: Tensor, x: Tensor) -> Tensor:
    (g,) = grad(outputs.sum(), x, create_graph=True)
    return g.flatten(1).norm(dim=1)


def reference(preset: str) -> float:
    model, _ = preset_case(preset)  # same seeds as the closure: torch.manual_seed(0) inside
    torch.manual_seed(0)
    real, fake = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 3, 1])
    torch.manual_seed(1)
    if preset in ("wgan_gp", "wgan_lp", "r1", "r2", "dragan"):
        u = torch.rand(5, 1, dtype=torch.float64)
        noise = torch.rand(5, 3, dtype=torch.float64)
        alpha = torch.rand(5, 1, dtype=torch.float64)
        x = {
            "wgan_gp": real + u * (fake - real),
            "wgan_lp": real + u * (fake - real),
            "r1": real,
            "r2": fake,
            "dragan": real + alpha * (0.5 * (real - real.mean()).pow(2).mean().sqrt() * noise),
        }[preset].requires_grad_()
        norms = _norms(model(x), x)
        if preset in ("r1", "r2"):
            return (10 / 2 * norms.pow(2).mean()).item()
        if preset == "wgan_lp":
            return (10 * torch.relu(norms - 1).pow(2).mean()).item()
        return (10 * (norms - 1).pow(2).mean()).item()
    if preset == "path_length":
        w = torch.randn(5, 2, dtype=torch.float64).requires_grad_()
        images = model(w)
        y = torch.randn(5, 6, dtype=torch.float64) / math.sqrt(6)
        (g,) = grad((images * y).sum(), w, create_graph=True)
        lengths = g.norm(dim=1)
        a = 0.0 + 0.01 * (lengths.mean() - 0.0)  # EMA from 0, as StyleGAN2
        return (2 * (lengths - a).pow(2).mean()).item()
    x = real.clone().requires_grad_()
    hidden = torch.tanh(model[0](x))
    logits = model[2](hidden)
    losses = F.cross_entropy(logits, labels, reduction="none")
    if preset == "double_backprop":
        return (0.1 * _norms(losses, x).pow(2).mean()).item()  # the default λ = 0.1
    if preset == "intermediate":
        return (0.01 * _norms(losses, hidden).pow(2).mean()).item()  # λ = 0.01
    if preset == "param_grad_norm":
        gs = grad(losses.mean(), list(model.parameters()))
        return (0.01 * torch.sqrt(sum(g.pow(2).sum() for g in gs))).item()  # λ = 0.01
    if preset == "derivative":
        (d1,) = grad(logits.sum(), x, create_graph=True)
        (d2,) = grad(d1.sum(), x, create_graph=True)
        return (0.01 * d2.pow(2).sum(1).mean()).item()  # λ = 0.01
    assert preset == "jacobian"
    jac = torch.stack([torch.stack([grad(logits[i, k], x, retain_graph=True)[0][i]
                                    for k in range(4)]) for i in range(5)])  # [B, K, D]
    directions = torch.linalg.qr(torch.randn(5, 4, 1, dtype=torch.float64)).Q  # [B, K, 1]
    projected = torch.einsum("bkd,bkn->bnd", jac, directions)
    return (0.01 * 4 / 1 * projected.pow(2).sum((1, 2))).mean().item()  # λ = 0.01


def test_value_equals_straight_line_formula(preset: str) -> None:
    model, run = preset_case(preset)
    names, params = params_of(model)
    value = run(make_penalty(preset, **preset_kwargs(preset)), model, dict(zip(names, params,
                                                                               strict=True)))
    assert value.item() == pytest.approx(reference(preset), rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("out_shape", ["B", "B1"])
@pytest.mark.parametrize("preset", ["r1", "wgan_gp"])
def test_image_critic_any_output_shape(preset: str, out_shape: str) -> None:
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Softplus(),
                                 torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 1)).double()
    real = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    x = real.clone().requires_grad_()
    out = critic(x)
    value = make_penalty(preset)(out if out_shape == "B1" else out.squeeze(1), x)
    (g,) = grad(critic(x).sum(), x, create_graph=True)
    norms = g.reshape(4, -1).norm(dim=1)  # per sample over C, H, W
    expected = 5 * norms.pow(2).mean() if preset == "r1" else 10 * (norms - 1).pow(2).mean()
    assert value.item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_pickles_and_copies_with_its_own_state(name: str) -> None:
    """Spawned processes (``ddp_spawn``) receive the penalties pickled; a copy's chosen
    computation must use the copy, not the original."""
    penalty = make_penalty(name, **{**preset_kwargs(name), "weight": 0.5})
    penalty.due()
    for copied in (pickle.loads(pickle.dumps(penalty)), copy.deepcopy(penalty)):
        assert copied.config == penalty.config and copied.weight == 0.5
        assert copied.steps_taken == 1
        method = copied._method
        functions = getattr(method, "penalty", None)
        if isinstance(functions, PenaltyFunctions):
            assert functions.exact is copied._exact  # the copy's own first-call checks
            assert functions.exact.running_mean.value is copied.ema  # and running mean
            assert functions.of_norms is copied._of_norms  # a pure function of the norms
            assert functions.of_gradients.__self__ is copied._of_norms


# SAM's rho: one number, the weight and the shift's size, set once.


def test_sam_and_asam_own_one_rho() -> None:
    """``sam(rho)`` sets the weight and the radius, ``asam(rho)`` the weight and the scale; a
    weight given alone to ``make_penalty`` sets both too; either given apart to the function is
    refused in one line naming the penalty to build instead."""
    penalty = sam(0.1)
    assert (penalty.weight, penalty.config.method.radius, penalty.config.step) == (0.1, 0.1, 0.1)
    penalty = asam(0.3)
    assert (penalty.weight, penalty.config.method.scale, penalty.config.shift) == (
        0.3, 0.3, "gradient")
    assert make_penalty("sam", weight=0.2).config.method.radius == 0.2
    assert make_penalty("sam").config.method.radius == 0.05
    assert make_penalty("sam", weight=0.2, radius=0.05).config.method.radius == 0.05
    for apart in ({"weight": 0.2}, {"radius": 0.2}, {"step": 0.2}):
        with pytest.raises(ValueError, match=r"^sam\(rho\) sets both its weight and its radius "
                                             r"to rho; .* param_grad_norm\(weight, "
                                             r"method='finite_difference', radius=\.\.\.\)"):
            sam(0.05, **apart)
    with pytest.raises(ValueError, match=r"^asam\(rho\) sets both its weight and its scale"):
        asam(0.5, scale=0.1)


@pytest.mark.parametrize("weight", [0.05, 0.1])
def test_a_weight_set_later_keeps_sams_radius(weight: float) -> None:
    """A weight w set after building (a schedule) scales SAM's correction and leaves its radius:
    with L = sum(theta^4)/4, grad L = theta^3, the step's gradient is
    theta^3 + (w/rho)((theta + rho g_hat)^3 - theta^3) at rho = 0.05 (float64, by hand), SAM's
    gradient (theta + rho g_hat)^3 at w = rho only."""
    rho = 0.05
    theta = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    penalty = sam(rho)
    penalty.weight = weight
    at = LossAt.run(lambda: theta.pow(4).sum() / 4)
    (at.loss + penalty(at, [theta])).backward()
    g = theta.detach() ** 3
    shifted = (theta.detach() + rho * g / g.norm()) ** 3
    expected = g + (weight / rho) * (shifted - g)
    torch.testing.assert_close(theta.grad, expected, rtol=1e-9, atol=0)
    assert penalty.config.method.radius == rho
