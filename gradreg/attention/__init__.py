r"""Scaled dot-product attention with a double backward, for exact penalties through attention.

Only the MATH backend of ``F.scaled_dot_product_attention`` has a double backward; the fused
kernels (flash, memory-efficient, CPU flash) have none, so an exact penalty (R1, WGAN-GP, double
backprop, ``param_grad_norm``) through ``nn.MultiheadAttention``, ``nn.TransformerEncoder`` or a
ViT fails in its double backward. Within :func:`differentiable_attention`, every
``F.scaled_dot_product_attention`` call is :func:`scaled_dot_product_attention`: the fused
kernel's forward, a backward that can be differentiated again and a forward-mode derivative, in
memory linear in the sequence.

The package, from the entry down:

* :mod:`gradreg.attention.routing`: :func:`differentiable_attention` (which calls are routed),
  :func:`scaled_dot_product_attention` (dropout, grouped heads, nested tensors, the backend);
* :mod:`gradreg.attention.functions`: the autograd functions (forward, backward, double
  backward, JVP and their derivatives), given a module of kernels;
* :mod:`gradreg.attention.blockwise`: the kernels as batched matmuls over blocks of queries and
  keys, and the derivation of the math;
* :mod:`gradreg.attention.triton`: the same functions as Triton kernels (the ``triton`` extra;
  imported only for ``backend="triton"``).
"""

from __future__ import annotations

from gradreg.attention.routing import (
    BACKENDS,
    differentiable_attention,
    explain_fused_attention,
    scaled_dot_product_attention,
)

__all__ = ["BACKENDS", "differentiable_attention", "explain_fused_attention",
           "scaled_dot_product_attention"]
