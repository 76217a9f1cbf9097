"""``torch.func`` transforms through ``differentiable_attention`` (grad of grad, jvp of grad,
vjp of grad): MATH attention's ops run, which the transforms differentiate as any others, so the
Hessian-vector products equal MATH's under ``torch.autograd`` (float64). The autograd Functions
of the fused path gave torch.func.grad of torch.func.grad 1.75 off and raised
NotImplementedError for jvp of grad."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jvp, vjp
from torch.nn.attention import SDPBackend, sdpa_kernel

import gradreg


@pytest.mark.parametrize("transform", ["grad_of_grad", "jvp_of_grad", "vjp_of_grad"])
def test_hessian_vector_products_by_torch_func_equal_maths(transform: str) -> None:
    torch.manual_seed(0)
    q, k, v, t = (torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(4))
    mask = torch.rand(5, 5) > 0.3
    mask.fill_diagonal_(True)

    def routed(q: torch.Tensor) -> torch.Tensor:
        with gradreg.differentiable_attention():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).square().sum()

    with sdpa_kernel(SDPBackend.MATH):
        leaf = q.clone().requires_grad_()
        (g,) = torch.autograd.grad(F.scaled_dot_product_attention(
            leaf, k, v, attn_mask=mask).square().sum(), leaf, create_graph=True)
        (expected,) = torch.autograd.grad((g * t).sum(), leaf)
    if transform == "grad_of_grad":
        got = grad(lambda q: (grad(routed)(q) * t).sum())(q)
    elif transform == "jvp_of_grad":
        got = jvp(grad(routed), (q,), (t,))[1]
    else:
        got = vjp(grad(routed), q)[1](t)[0]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
