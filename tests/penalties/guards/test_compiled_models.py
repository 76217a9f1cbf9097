"""Penalties on torch.compile'd models: the methods without a double backward give what they
give on the eager model (float64: the compiled kernels' rounding is not amplified by the
difference quotients), also after a training step compiled the model's backward with donated
buffers (one backward per compiled graph); exact ones are refused with the methods that work
named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradreg import GradientError
from gradreg.penalties import presets
from gradreg.penalties.methods.param_gradient import LossAt


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def critic_step(critic: nn.Module, params: list[torch.Tensor], name: str, **options
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One penalty on a critic called with the critic itself; its value and parameter grads."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x.requires_grad_()
    torch.manual_seed(2)  # the perturbation's noise
    value = presets.make_penalty(name, **options)(critic, x)
    return value.detach(), list(torch.autograd.grad(value, params))


def gnp_step(model: nn.Module, params: list[torch.Tensor]
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.randn(6, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def loss_fn() -> torch.Tensor:
        return F.mse_loss(model(x), y)

    loss = loss_fn()
    value = presets.param_grad_norm(0.1, method="finite_difference", step=1e-2)(
        LossAt(loss_fn, loss), params)
    return value.detach(), list(torch.autograd.grad(loss + value, params))


def check_the_methods_without_double_backward(backend: str) -> None:
    eager = mlp()
    compiled = torch.compile(eager, backend=backend)
    params = list(eager.parameters())
    # a training step first: the compiled backward, compiled by a backward that keeps no graph,
    # donates its buffers and takes no retained backward after it
    compiled(torch.randn(6, 4, dtype=torch.float64, requires_grad=True)).sum().backward()
    eager.zero_grad(set_to_none=True)
    cases = [lambda m: critic_step(m, params, "approx_r1"),
             lambda m: critic_step(m, params, "r1", method="finite_difference", step=1e-2),
             lambda m: gnp_step(m, params)]
    for case in cases:
        value, grads = case(compiled)
        expected_value, expected = case(eager)
        torch.testing.assert_close(value, expected_value, rtol=1e-9, atol=1e-12)
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    for options in ({}, {"chunks": 2}):
        with pytest.raises(GradientError, match="torch.compile'd model.*method='perturbation'"):
            critic_step(compiled, params, "r1", **options)
    with pytest.raises(GradientError, match="torch.compile'd model"):  # the forward shared
        x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
        presets.r1(10.0)(compiled(x), x)


def test_on_a_model_compiled_through_aot_autograd() -> None:
    check_the_methods_without_double_backward("aot_eager")


@pytest.mark.slow
def test_on_a_model_compiled_by_inductor() -> None:
    torch.compiler.reset()
    check_the_methods_without_double_backward("inductor")


@pytest.mark.parametrize("name, options", [
    ("approx_r1", {}), ("r1", {"method": "finite_difference", "step": 1e-2}),
], ids=["perturbation", "finite_difference"])
def test_coupled_samples_of_a_compiled_model_are_refused(name: str, options: dict) -> None:
    """The coupling probe of a compiled model runs a forward of its own (its graph is
    backpropagated once), and still sees BatchNorm's batch statistics."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    compiled = torch.compile(eager.double(), backend="aot_eager")
    compiled(torch.randn(6, 4, dtype=torch.float64, requires_grad=True)).sum().backward()
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(GradientError, match="samples are coupled"):
        presets.make_penalty(name, **options)(compiled, x)
