"""The computation methods against the exact double-backward gradient, within their stated error."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradreg
from gradreg import GradientError
from gradreg.penalties import (
    GradientPenalty,
    interpolate,
    lazy_optimizer_kwargs,
    make_penalty,
    methods,
)
from gradreg.penalties.guards import precision
from tests.penalties.parameter_gradients import value_and_grad
from tests.residual_net import ResidualNet
from tests.tf32 import EmulatedTF32


def smooth_critic(dtype: torch.dtype = torch.float64, n_in: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(n_in, 16), nn.Tanh(), nn.Linear(16, 16), nn.Softplus(),
                          nn.Linear(16, 1)).to(dtype)
    with torch.no_grad():  # input-gradient norms on both sides of 1 (WGAN-LP is one-sided)
        model[4].weight.mul_(20)  # norms from 0.5 to 1.8
    return model


def points(dtype: torch.dtype = torch.float64, batch: int = 32, n_in: int = 8) -> Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, n_in, dtype=dtype).requires_grad_()


def relative_error(estimate: Tensor, exact: Tensor) -> float:
    return float((estimate - exact).norm() / exact.norm())


CONFIGS = [("wgan_gp", {}), ("wgan_lp", {}), ("r1", {}),
           ("r1", {"power": 1.0, "p": 1.0, "reduction": "sum"})]


@pytest.mark.parametrize(("preset", "overrides"), CONFIGS)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-6), (torch.float32, 3e-3)])
def test_finite_difference_within_stated_error(preset: str, overrides: dict, dtype: torch.dtype,
                                               tolerance: float) -> None:
    model, x = smooth_critic(dtype), points(dtype)
    exact_value, exact = value_and_grad(make_penalty(preset, **overrides), model, model(x), x)
    penalty = make_penalty(preset, method="finite_difference", **overrides)
    value, estimate = value_and_grad(penalty, model, model, x)
    assert exact.norm() > 0
    torch.testing.assert_close(value, exact_value)  # the value is exact, only the gradient is not
    assert relative_error(estimate, exact) < tolerance


def test_finite_difference_closure_over_a_per_sample_loss() -> None:
    model, x = smooth_critic(n_in=8), points()
    head = nn.Linear(1, 3).double()
    labels = torch.tensor([0, 1, 2, 1] * 8)

    def losses(inputs: Tensor) -> Tensor:
        return F.cross_entropy(head(model(inputs)), labels, reduction="none")

    _, exact = value_and_grad(make_penalty("double_backprop"), model, losses(x), x)
    _, estimate = value_and_grad(make_penalty("double_backprop", method="finite_difference"),
                                 model, losses, x)
    assert relative_error(estimate, exact) < 1e-6


@pytest.mark.parametrize("method", ["finite_difference", "perturbation"])
def test_estimates_at_embeddings_reach_the_embedding_matrix(method: str) -> None:
    """Double backprop at a model's embeddings (points computed by a graph): every parameter's
    gradient, the embedding matrix's included, is that of float64 double backward (finite
    difference to 1e-6; the perturbation estimate, averaged over 4000 probes, to 10%). A
    shift of the points detached from their graph would leave the matrix's gradient 2e5 times
    off (relative error)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(12, 6), nn.Linear(6, 8), nn.Tanh(),
                          nn.Linear(8, 3)).double()
    ids, labels = torch.randint(0, 12, (16, 5)), torch.randint(0, 3, (16,))

    def losses(e: Tensor) -> Tensor:
        return F.cross_entropy(model[1:](e).mean(1), labels, reduction="none")

    def gradients(penalty: GradientPenalty, call: object) -> Tensor:
        e = model[0](ids)
        value = penalty(call(e), e)
        return torch.cat([g.flatten() for g in torch.autograd.grad(value, model.parameters())])

    exact = gradients(make_penalty("double_backprop"), losses)
    options = {"count": 4000} if method == "perturbation" else {}
    estimate = gradients(make_penalty("double_backprop", method=method, **options),
                         lambda e: losses)
    assert relative_error(estimate, exact) < (0.1 if method == "perturbation" else 1e-6)


@pytest.mark.parametrize(("activation", "op"), [
    (nn.ReLU(), "Relu"),
    (lambda h: torch.nn.functional.relu(h), "Relu"),  # functional: no module to find
    (nn.LeakyReLU(), "LeakyRelu"),
    (nn.Hardtanh(), "Hardtanh"),
    (lambda h: h.clamp(-1, 1), "Clamp"),
    (lambda h: h.abs(), "Abs"),
])
def test_finite_difference_refuses_piecewise_linear_models(activation: object, op: str) -> None:
    first, last = nn.Linear(4, 8), nn.Linear(8, 1)
    model = lambda inputs: last(activation(first(inputs))).squeeze(1)  # noqa: E731
    x = torch.randn(5, 4, requires_grad=True)
    penalty = make_penalty("r1", method="finite_difference")
    for _ in range(2):  # refused again: a failed check does not count as the first call's
        with pytest.raises(GradientError, match=rf"piecewise-linear model \({op} in its graph"):
            penalty(model, x)


class _FunctionalRelu(nn.Module):
    def forward(self, h: Tensor) -> Tensor:
        return F.relu(h)


@pytest.mark.parametrize(("activation", "op"), [
    (_FunctionalRelu, "Relu"),
    (lambda: nn.ReLU(inplace=True), "Relu"),
    (nn.LeakyReLU, "LeakyRelu"),
])
def test_finite_difference_refuses_kinks_inside_residual_blocks(activation: object,
                                                                op: str) -> None:
    """The kinks sit behind BatchNorm, convolutions and residual additions (a walk that stopped
    early, as on torch 2.11 before the fix, never reached them and accepted the model)."""
    torch.manual_seed(0)
    model = ResidualNet(activation).eval()
    x = torch.randn(3, 1, 6, 6, requires_grad=True)
    with pytest.raises(GradientError, match=rf"piecewise-linear model \({op} in its graph"):
        make_penalty("r1", method="finite_difference")(lambda q: model(q)[:, 0], x)


def test_finite_difference_accepts_smooth_models_and_refuses_half_precision() -> None:
    pooled = nn.Sequential(nn.Conv2d(1, 2, 3), nn.SiLU(), nn.AvgPool2d(2), nn.Flatten(),
                           nn.Linear(8, 1), nn.Softplus(), nn.Flatten(0))
    methods.check_smooth(pooled(torch.randn(3, 1, 6, 6)))  # no kink: passes
    with pytest.raises(GradientError, match="MaxPool2DWithIndices"):
        methods.check_smooth(nn.MaxPool2d(2)(torch.randn(1, 1, 4, 4, requires_grad=True)))


def test_step_follows_the_precision_the_arithmetic_ran_in() -> None:
    """float64 1e-6, float32 1e-2, TF32 0.5 (convolutions under cuDNN's default, or matmuls at
    precision 'high'); bf16 arithmetic (autocast, matmul precision 'medium') is refused."""
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8, 1))
    dense = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    conv_out, dense_out = conv(torch.randn(2, 1, 4, 4)), dense(torch.randn(2, 4))
    step, roundoff = precision.default_step, precision.unit_roundoff
    assert step(roundoff(nn.Linear(4, 1).double()(torch.randn(2, 4).double()))) == 1e-6
    assert step(precision.unit_roundoff(conv_out)) == 1e-2  # the CPU runs float32 as float32
    conv_names = gradreg.graph.graph_node_names([conv_out])
    dense_names = gradreg.graph.graph_node_names([dense_out])
    tf32 = partial(precision.cuda_float32_roundoff, conv_tf32=True, matmul_precision="highest")
    assert step(tf32(conv_names)) == 0.5 and precision.TF32_ROUNDOFF == 2.0**-11
    assert step(tf32(dense_names)) == 1e-2  # torch's default: float32 matmuls stay float32
    assert step(precision.cuda_float32_roundoff(conv_names, conv_tf32=False,
                                              matmul_precision="highest")) == 1e-2
    assert step(precision.cuda_float32_roundoff(dense_names, conv_tf32=False,
                                              matmul_precision="high")) == 0.5
    with pytest.raises(GradientError, match="float32 or float64"):
        step(precision.cuda_float32_roundoff(dense_names, conv_tf32=False,
                                           matmul_precision="medium"))
    with pytest.raises(GradientError, match="float32 or float64"):
        step(torch.finfo(torch.bfloat16).eps / 2)
    head, labels = nn.Linear(4, 2), torch.tensor([0, 1] * 2)
    x = torch.randn(4, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a float32 loss of bf16 arithmetic
        assert precision.unit_roundoff(F.cross_entropy(head(x), labels)) == 2.0**-8
        with pytest.raises(GradientError, match="disable autocast around it"):
            make_penalty("double_backprop", method="finite_difference")(
                lambda q: F.cross_entropy(head(q), labels, reduction="none"), x)


@pytest.mark.parametrize("activation", [nn.Tanh, nn.ELU, nn.Softplus])
def test_finite_difference_error_in_tf32_with_its_step(activation: type[nn.Module]) -> None:
    """A DCGAN-style critic's WGAN-GP gradient in emulated TF32: with TF32's step (0.5) within the
    documented 6e-2 of float64 double backward; float32's step (1e-2) is off by over 0.1 (the
    error measured on an H100 before the step followed the arithmetic)."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Conv2d(3, 8, 4, 2, 1), activation(), nn.Conv2d(8, 16, 4, 2, 1),
                           activation(), nn.Flatten(), nn.Linear(16 * 4 * 4, 1), nn.Flatten(0))
    real, fake = torch.randn(16, 3, 16, 16), torch.randn(16, 3, 16, 16)
    points = interpolate(real, fake)
    exact64 = copy.deepcopy(critic).double()
    p64 = points.detach().double().requires_grad_()
    _, exact = value_and_grad(make_penalty("wgan_gp"), exact64, exact64(p64), p64)
    errors = {}
    for step in (precision.STEPS[precision.TF32_ROUNDOFF], 1e-2):
        penalty = make_penalty("wgan_gp", method="finite_difference", step=step)
        with EmulatedTF32():
            _, estimate = value_and_grad(penalty, critic, critic, points.detach().requires_grad_())
        errors[step] = relative_error(estimate.double(), exact)
    assert errors[0.5] < 6e-2 < 0.1 < errors[1e-2], errors


def test_callable_outputs_give_the_same_exact_penalty() -> None:
    model, x = smooth_critic(), points()
    from_tensor = value_and_grad(make_penalty("wgan_gp"), model, model(x), x)
    from_callable = value_and_grad(make_penalty("wgan_gp"), model, model, x)
    torch.testing.assert_close(from_callable, from_tensor, rtol=0, atol=0)


@pytest.mark.parametrize(("reduction", "scale"), [("mean", 1.0), ("sum", 32 / 8)])
def test_subsample_is_the_penalty_of_the_first_samples(reduction: str, scale: float) -> None:
    model, x = smooth_critic(), points(batch=32)
    head = x[:8].detach().requires_grad_()
    exact_value, exact = value_and_grad(make_penalty("r1", reduction=reduction), model,
                                        model(head), head)
    value, grad = value_and_grad(make_penalty("r1", reduction=reduction, subsample=0.25), model,
                                 model, x)
    torch.testing.assert_close(value, exact_value * scale)
    torch.testing.assert_close(grad, exact * scale)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"method": "adjoint"}, "method must be one of .*'double_backward'"),
     ({"method": "finite_difference", "projection": "gaussian"}, "supports projection='sum'"),
     ({"method": "finite_difference", "target": "ema"}, "a numeric target"),
     ({"subsample": 0.0}, r"subsample must be in \(0, 1\]"),
     ({"method": "finite_difference", "step": -1.0}, "step .* must be a number > 0")],
)
def test_invalid_method_options(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradientPenalty(**options)


def test_methods_other_than_exact_need_a_callable() -> None:
    model, x = smooth_critic(), points()
    with pytest.raises(ValueError, match="need outputs as a callable"):
        make_penalty("r1", method="finite_difference")(model(x), x)
    with pytest.raises(ValueError, match="need outputs as a callable"):
        make_penalty("r1", subsample=0.5)(model(x), x)


@pytest.mark.parametrize("options", [{"chunks": 2}, {"subsample": 0.5},
                                     {"method": "finite_difference"}],
                         ids=["chunks", "subsample", "finite_difference"])
@pytest.mark.parametrize("batchnorm", ["torch", "gradreg"])
def test_methods_on_part_of_the_batch_refuse_training_batchnorm(options: dict,
                                                                batchnorm: str) -> None:
    """BatchNorm in training mode couples the samples: chunks or a subsample would normalize by
    other statistics, and finite differences' per-sample steps no longer add up; refused with
    the fix. In eval mode the same options run."""
    torch.manual_seed(0)
    model = ResidualNet(nn.Tanh, channels=2, blocks=1).double()
    if batchnorm == "gradreg":
        model = gradreg.convert_batchnorm(model)
    x = torch.randn(8, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    scores = lambda q: model(q)[:, 0]  # noqa: E731
    with pytest.raises(GradientError, match=r"BatchNorm in training mode \(.*BatchNorm"):
        make_penalty("r1", **options)(scores, x)
    model.eval()
    make_penalty("r1", **options)(scores, x)


def test_lazy_optimizer_kwargs_is_stylegan2s_correction() -> None:
    kwargs = lazy_optimizer_kwargs(2e-3, (0.0, 0.99), every=16)
    assert kwargs["lr"] == pytest.approx(2e-3 * 16 / 17)
    assert kwargs["betas"] == pytest.approx((0.0, 0.99 ** (16 / 17)))
    kwargs = lazy_optimizer_kwargs(1e-3, (0.5, 0.9), every=1)  # a separate step every step
    assert kwargs["lr"] == pytest.approx(5e-4)
    assert kwargs["betas"] == pytest.approx((0.5**0.5, 0.9**0.5))
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        lazy_optimizer_kwargs(1e-3, every=0)
