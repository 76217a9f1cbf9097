"""An autograd Function whose backward is not differentiable (``@once_differentiable``), for the
tests that a double backward through it is refused rather than silently wrong."""

from __future__ import annotations

import torch


class OnceSquare(torch.autograd.Function):
    """y = v², backward 2·v·g computed under no_grad (``@once_differentiable``)."""

    @staticmethod
    def forward(ctx, v):
        ctx.save_for_backward(v)
        return v * v

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (v,) = ctx.saved_tensors
        return 2 * v * grad_out
