"""Exact penalties through a timm model's fused attention (the ``timm`` extra; skipped without
it): R1 of a timm ViT critic built from its constructor (no weights), whose attention calls
``F.scaled_dot_product_attention``, equals the same model with MATH attention (float64); and a
penalty that runs the critic itself (``chunks``) needs no context of the caller."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradreg import GradientError, differentiable_attention
from gradreg.penalties import presets

timm = pytest.importorskip("timm")


def critic() -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, in_chans=1,
        num_classes=1, embed_dim=16, depth=2, num_heads=2).double().eval()
    assert all(block.attn.fused_attn for block in model.blocks)  # F.scaled_dot_product_attention
    return model


def test_r1_through_a_timm_vit_equals_the_math_backend() -> None:
    model = critic()
    images = torch.randn(4, 1, 16, 16, dtype=torch.float64)

    def r1(context, **options) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The penalty and every parameter's gradient (zero where it has none)."""
        model.zero_grad(set_to_none=True)
        x = images.clone().requires_grad_()
        penalty = presets.r1(10.0, **options)
        with context():
            value = penalty(model, x) if options else penalty(model(x).squeeze(1), x)
        value.backward()
        return value.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                for p in model.parameters()]

    with pytest.raises(GradientError, match="differentiable_attention"):
        r1(torch.enable_grad)  # the fused kernel alone has no double backward
    expected_value, expected = r1(lambda: sdpa_kernel(SDPBackend.MATH))
    # the caller's forward inside differentiable_attention, and the penalty's own forward
    for value, grads in (r1(differentiable_attention), r1(torch.enable_grad, chunks=2)):
        torch.testing.assert_close(value, expected_value)
        assert sum(bool(grad.any()) for grad in expected) >= 30  # of the 32 parameters
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want)
