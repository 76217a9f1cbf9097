r"""Property-based tests of the penalty API: the right value or a clear error, never a silent NaN.

The model is :math:`f(x_i) = \tfrac12 \sum_j a_j x_{ij}^2` (per sample, any non-batch shape), whose
per-sample input gradient is :math:`g_i = a \odot x_i` in closed form, so every penalty has a
straight-line reference:
:math:`w \cdot \text{gain} \cdot \operatorname{reduce}_i \phi(\lVert a \odot x_i \rVert_p - c)^q`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradreg import GradientError
from gradreg.penalties import GradientPenalty, gradient_penalty

SETTINGS = settings(max_examples=30, deadline=None)
# relative tolerance of the value per dtype (the reference is computed in float64)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}


def quadratic(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Per-sample :math:`\\tfrac12 \\sum_j a_j x_{ij}^2`, shape [B]."""
    return 0.5 * (a * x.square()).flatten(1).sum(1)


def reference(x: torch.Tensor, a: torch.Tensor, *, target: float, one_sided: bool, power: float,
              p: float, reduction: str) -> float:
    """The penalty from the closed-form gradient a * x, in float64."""
    g = (a.detach().double() * x.detach().double()).flatten(1)
    norms = torch.linalg.vector_norm(g, ord=p, dim=1)
    deviation = norms - target
    deviation = deviation.clamp_min(0) if one_sided else deviation.abs()
    values = deviation.pow(power)
    return float(values.mean() if reduction == "mean" else values.sum())


configs = st.fixed_dictionaries({
    "target": st.sampled_from([0.0, 0.5, 1.0]),
    "one_sided": st.booleans(),
    "power": st.sampled_from([1.0, 2.0, 3.0]),
    "p": st.sampled_from([1.0, 2.0, 3.0, math.inf]),
    "reduction": st.sampled_from(["mean", "sum"]),
})
shapes = st.tuples(st.integers(1, 5), st.lists(st.integers(1, 3), min_size=1, max_size=3))


def sample(shape: tuple[int, list[int]], dtype: torch.dtype, seed: int,
           zero_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    batch, features = shape
    rng = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *features, generator=rng, dtype=torch.float64)
    if zero_rows:
        x[::2] = 0.0  # every other sample has a zero gradient
    a = torch.randn(*features, generator=rng, dtype=torch.float64)
    return x.to(dtype).requires_grad_(), a.to(dtype).requires_grad_()


@SETTINGS
@given(shape=shapes, config=configs, dtype=st.sampled_from(list(RTOL)),
       seed=st.integers(0, 2**16), zero_rows=st.booleans(),
       weight=st.sampled_from([0.0, 1.0, 10.0]), gain=st.sampled_from([0.5, 1.0]))
def test_value_matches_closed_form(shape, config, dtype, seed, zero_rows, weight, gain) -> None:
    x, a = sample(shape, dtype, seed, zero_rows)
    expected = reference(x, a, **config)
    functional = gradient_penalty(quadratic(x, a), x, **config).detach()
    module = GradientPenalty(weight=weight, gain=gain, **config)(quadratic(x, a), x).detach()
    tol = RTOL[dtype] * max(1.0, abs(expected))
    assert functional.dtype == dtype
    assert abs(float(functional) - expected) <= tol
    assert abs(float(module) - weight * gain * expected) <= tol * max(1.0, weight * gain)


@SETTINGS
@given(shape=shapes, config=configs, seed=st.integers(0, 2**16))
def test_zero_gradients_give_finite_parameter_gradients(shape, config, seed) -> None:
    """Norm 0 (a sample whose gradient vanishes) is where sqrt and |t| have no derivative: the
    penalty is still exact and its gradient w.r.t. the model's parameters finite."""
    x, a = sample(shape, torch.float64, seed, zero_rows=True)
    value = GradientPenalty(**config)(quadratic(x, a), x)
    (grad_a,) = torch.autograd.grad(value, a)
    assert abs(value.item() - reference(x, a, **config)) <= 1e-12 * max(1.0, value.item())
    assert torch.isfinite(grad_a).all()


@SETTINGS
@given(shape=shapes, config=configs, seed=st.integers(0, 2**16),
       bad=st.sampled_from([math.nan, math.inf, -math.inf]))
@example(shape=(2, [2]), seed=1, bad=math.nan,  # WGAN-GP's case: the one a NaN could hide in
         config={"target": 1.0, "one_sided": False, "power": 2.0, "p": 2.0, "reduction": "mean"})
def test_non_finite_inputs_raise(shape, config, seed, bad) -> None:
    """One NaN/Inf anywhere in the batch: GradientError (check_finite, on by default)."""
    x, a = sample(shape, torch.float64, seed)
    with torch.no_grad():
        x.view(-1)[seed % x.numel()] = bad
    with pytest.raises(GradientError, match="points of call 1 contain NaN or Inf"):
        GradientPenalty(**config)(quadratic(x, a), x)


def test_empty_batch_is_a_clear_error() -> None:
    x = torch.zeros(0, 3, requires_grad=True)
    with pytest.raises(GradientError, match="empty batch"):
        GradientPenalty()(x.square().sum(1), x)


def test_empty_batch_is_a_clear_error_in_the_functional_form() -> None:
    x = torch.zeros(0, 3, requires_grad=True)
    with pytest.raises(GradientError, match="empty batch"):
        gradient_penalty(x.square().sum(1), x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_non_float_points_are_a_clear_error(dtype) -> None:
    x = torch.ones(2, 3, dtype=dtype)
    with pytest.raises(GradientError, match="only floating-point tensors have gradients"):
        GradientPenalty()(torch.ones(2, requires_grad=True), x)


def test_points_the_outputs_do_not_depend_on_are_a_clear_error() -> None:
    x, other = torch.ones(2, 3, requires_grad=True), torch.ones(2, 3, requires_grad=True)
    with pytest.raises(GradientError, match="do not depend on input 0"):
        GradientPenalty()(x.square().sum(1), other)
