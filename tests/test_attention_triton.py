"""Attention's Triton kernels (``differentiable_attention(backend="triton")``): the forward, the
gradient, the double backward, the JVP and its gradient equal the MATH backend's, for every mask
kind of the blockwise path, in float64 and float32; third order; R1 through a transformer.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before any test imports them) on CPU tensors: tiny sequences, several blocks of
4. Skipped unless Triton is installed at the release they are checked with (3.9, the ``triton``
extra of CI's torch 2.13 venv; the CUDA builds of torch bring their own, older ones); without
Triton the blockwise path is the only one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

pytest.importorskip("triton", minversion="3.9")  # the release checked: one CI venv has it

from gradreg import GradientError, differentiable_attention
from gradreg.attention import blockwise, scaled_dot_product_attention
from gradreg.attention import triton as triton_attention
from gradreg.attention.routing import _kernels
from tests.test_attention import (
    FUSED,
    MASKS,
    assert_float64_derivatives_equal,
    attention_case,
    attention_of,
    math_backend,
    math_backend_derivatives,
    math_derivatives,
    qkv,
    r1_gradients,
    transformer_critic,
    with_dead_row,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 4 queries x 4 keys: several of each, a causal block skipped."""
    monkeypatch.setattr(triton_attention, "BLOCK", 4 if DEVICE == "cpu" else 16)


def on_device(inputs: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(x.detach().to(DEVICE, dtype).requires_grad_() for x in inputs)


def triton(options: dict):
    return attention_of(scaled_dot_product_attention, options, backend="triton")


def options_on_device(options: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in options.items()}


@pytest.mark.parametrize("kind", MASKS)
def test_triton_derivatives_equal_the_math_backends(kind: str) -> None:
    """float64: the value, the gradient, the double backward (w.r.t. q, k, v, a learned mask and
    the output cotangent), the JVP and its gradient, as the blockwise path's test."""
    options, inputs = attention_case(kind, 7, 6)
    options, inputs = options_on_device(options), on_device(inputs, torch.float64)
    got = math_derivatives(triton(options), inputs, dual=True)
    assert_float64_derivatives_equal(got, math_backend_derivatives(options, inputs))


@pytest.mark.parametrize("kind", ["causal_and_bool", "float"])
def test_triton_float32_equals_the_math_backend(kind: str) -> None:
    """float32 (IEEE products): within float32 rounding of MATH's float32 derivatives."""
    options, inputs = attention_case(kind, 9, 7)
    options, inputs = options_on_device(options), on_device(inputs, torch.float32)
    if "attn_mask" in options and options["attn_mask"].is_floating_point():
        options["attn_mask"] = options["attn_mask"].float()
    got = math_derivatives(triton(options), inputs, dual=True)
    expected = math_backend_derivatives(options, inputs)
    for a, b in zip(got, expected, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-4, atol=1e-5)


def test_a_dead_row_is_zero_with_zero_gradient() -> None:
    """A query whose keys are all masked: output 0 (as torch's fused kernels since 2.5) and the
    blockwise path's derivatives there."""
    q, k, v = on_device(qkv(), torch.float64)
    mask = with_dead_row().to(DEVICE)
    weights = torch.randn(2, 3, 5, 3, generator=torch.Generator().manual_seed(2),
                          dtype=torch.float64).to(DEVICE)
    out, lse = triton_attention.forward(blockwise.Attention(q, k, v, mask, False, 0.5))
    assert bool((out[..., 2, :] == 0).all()) and bool((lse[..., 2] == float("inf")).all())
    problem = blockwise.Attention(q.detach(), k.detach(), v.detach(), mask, False, 0.5)
    for kernels in (triton_attention, blockwise):
        grads = kernels.vjp(problem, lse, out, weights, False)
        assert all(bool(g.isfinite().all()) for g in grads[:3])
    torch.testing.assert_close(triton_attention.vjp(problem, lse, out, weights, False)[:3],
                               blockwise.vjp(problem, lse, out, weights, False)[:3])


def test_third_order_on_the_triton_kernels_equals_the_math_backend() -> None:
    """The double backward differentiated again (in differentiable ops, on the Triton kernels'
    first and second order): equal to MATH's third derivatives."""
    q, k, v = on_device(qkv(lq=5, lk=6), torch.float64)
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(2, 3, 5, 3, generator=g, dtype=torch.float64).to(DEVICE)
    first, second = ([torch.randn(x.shape, generator=g, dtype=torch.float64).to(DEVICE)
                      for x in (q, k, v)] for _ in range(2))

    def third(attention) -> list[torch.Tensor]:
        out = attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(out, (q, k, v), weight, create_graph=True)
        hessian = torch.autograd.grad(grads, (q, k, v), first, create_graph=True)
        return list(torch.autograd.grad(hessian, (q, k, v), second))

    got = third(lambda *xs, **o: scaled_dot_product_attention(*xs, **o, backend="triton"))
    with sdpa_kernel(SDPBackend.MATH):
        expected = third(FUSED)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_r1_through_a_transformer_with_the_triton_backend_equals_the_math_backend() -> None:
    critic = transformer_critic().to(DEVICE)
    x = torch.randn(3, 5, 8, dtype=torch.float64, device=DEVICE)
    value, grads = r1_gradients(critic, x, lambda: differentiable_attention(backend="triton"))
    expected_value, expected = r1_gradients(critic, x, math_backend)
    torch.testing.assert_close(value, expected_value)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_the_backend_is_chosen_by_device_and_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"auto"``: the blockwise path (Triton by name only, until run on a GPU); an unknown
    name is refused naming the valid ones."""
    assert _kernels("auto", torch.zeros(1)) is blockwise
    assert _kernels("triton", torch.zeros(1)) is triton_attention
    assert _kernels("blockwise", torch.zeros(1)) is blockwise
    with (pytest.raises(ValueError, match="unknown attention backend 'flash'.*'triton'"),
          differentiable_attention(backend="flash")):
        pass
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="unknown attention backend"):
        scaled_dot_product_attention(q, q, q, backend="cuda")
    if DEVICE == "cpu":  # the kernels run on the CPU only interpreted
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(GradientError, match="backend='triton' runs its kernels on CUDA"):
            scaled_dot_product_attention(q, q, q, backend="triton")


@pytest.mark.cuda
def test_the_triton_kernels_run_on_cuda() -> None:
    q, k, v = on_device(qkv(), torch.float32)
    assert _kernels("auto", q) is blockwise
    out = scaled_dot_product_attention(q, k, v, is_causal=True, backend="triton")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_bfloat16_is_computed_in_float32_as_accurately_as_the_math_backend() -> None:
    """bfloat16 inputs run the kernels in float32 and come back in bfloat16: the gradient and the
    double backward are as close to float64 as MATH's bfloat16 ones (as the blockwise path's)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, weight, *cotangents = (torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64)
                                    .to(DEVICE) for _ in range(7))

    def derivatives(attention, dtype: torch.dtype) -> list[torch.Tensor]:
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = attention(*xs, is_causal=True)
        grads = torch.autograd.grad(out, xs, weight.to(dtype), create_graph=True)
        second = torch.autograd.grad(grads, xs, [c.to(dtype) for c in cotangents])
        assert all(t.dtype == dtype for t in (out, *grads, *second))
        return [t.detach().double() for t in (*grads, *second)]

    def errors(got: list[torch.Tensor]) -> list[float]:
        return [float((a - r).norm() / r.norm()) for a, r in zip(got, exact, strict=True)]

    def ours(*xs: torch.Tensor, **options: bool) -> torch.Tensor:
        return scaled_dot_product_attention(*xs, **options, backend="triton")

    exact = derivatives(ours, torch.float64)
    got = errors(derivatives(ours, torch.bfloat16))
    with sdpa_kernel(SDPBackend.MATH):
        math = errors(derivatives(FUSED, torch.bfloat16))
    for a, b in zip(got, math, strict=True):
        assert a < 1.5 * b, (got, math)
