r"""Scaled dot-product attention with a double backward, for exact penalties through attention.

Only the MATH backend of ``F.scaled_dot_product_attention`` has a double backward; the fused
kernels (flash, memory-efficient, CPU flash) have none, so an exact penalty (R1, WGAN-GP, double
backprop, ``param_grad_norm``) through ``nn.MultiheadAttention``, ``nn.TransformerEncoder`` or a
ViT fails in its double backward. :func:`scaled_dot_product_attention` is an autograd function
whose forward is the fused kernel (the backend the caller's ``sdpa_kernel`` context chose) and
whose backward is written in differentiable torch ops, so a gradient taken with
``create_graph=True`` through it can be differentiated again. For queries :math:`Q`, keys
:math:`K`, values :math:`V`, scale :math:`s` and additive mask :math:`M` (:math:`-\infty` where a
boolean mask or ``is_causal`` forbids a key):

.. math::

    S = s\,QK^\top + M, \quad P = \operatorname{softmax}_{\text{row}}(S), \quad O = PV;

    \bar V = P^\top \bar O, \quad \bar P = \bar O V^\top, \quad
    \bar S = P \odot (\bar P - \operatorname{rowsum}(\bar O \odot O)), \quad
    \bar Q = s\,\bar S K, \quad \bar K = s\,\bar S^\top Q, \quad \bar M = \bar S,

and the forward-mode derivative (a Jacobian-vector product, for the spectral norm and the exact
Hessian penalty) for tangents :math:`\dot Q, \dot K, \dot V, \dot M`:

.. math::

    \dot S = s(\dot Q K^\top + Q \dot K^\top) + \dot M, \quad
    \dot P = P \odot (\dot S - \operatorname{rowsum}(P \odot \dot S)), \quad
    \dot O = \dot P V + P \dot V,

where :math:`P` is recomputed from :math:`Q, K` in the backward and the JVP (a row whose keys are
all masked has :math:`P = 0` where the kernel's output there is 0, as on torch 2.13 and 2.14, and
:math:`P =` NaN where it is NaN, as on torch 2.4: the backward is that of the forward that ran);
a backward with ``create_graph=True`` keeps it for the later backward of the same forward (the
task loss's), as the gradient's graph holds it until then anyway. The forward keeps the fused
kernel's memory (no :math:`L \times S` tensor is saved); the backward materializes
:math:`L \times S` per head, as the MATH path's forward does.

:func:`differentiable_attention` routes every ``F.scaled_dot_product_attention`` call made while
it is active (``nn.MultiheadAttention`` and the ``nn.TransformerEncoder`` layers in train and eval
mode, timm's ViT with ``fused_attn``, Hugging Face models with ``attn_implementation="sdpa"``)
through :func:`scaled_dot_product_attention`. Wrap it around the forward whose graph a penalty
differentiates, and only that forward: a task loss without a penalty keeps the fused backward.
A penalty called with the model itself (``penalty(D, x)``) by an exact method enters it by itself.

``dropout_p > 0`` (attention dropout in training mode) runs the MATH backend for that call: the
dropout mask of a fused kernel cannot be recovered for the backward, and MATH's dropout is an
ordinary differentiable op, so the result equals a model with MATH attention everywhere (the same
random numbers). ``enable_gqa`` (torch >= 2.5) repeats the key and value heads before the kernel.
Nested (ragged) tensors are refused.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from gradreg.autograd import GradientError
from gradreg.torch_compat import attention_in_functional

__all__ = ["differentiable_attention", "explain_fused_attention", "scaled_dot_product_attention"]

#: The fused entry point that :func:`differentiable_attention` replaces (bound at import, so a
#: replacement of the module attribute never reaches it).
_FUSED = F.scaled_dot_product_attention


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, scale: float,
            out: Tensor) -> Tensor:
    """The attention probabilities :math:`P`; a row whose keys are all masked is what the
    kernel's output ``out`` has there: 0 (torch 2.13, 2.14), or NaN (torch 2.4)."""
    s = torch.matmul(q * scale, k.transpose(-2, -1))  # the scale on L x E, not on L x S
    if is_causal:
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if mask is None:
        return torch.softmax(s, dim=-1)
    dead = s.amax(dim=-1, keepdim=True) == float("-inf")  # no host sync: a mask, not a branch
    fill = torch.where(out.isnan().any(dim=-1, keepdim=True), float("nan"), 0.0).to(s.dtype)
    return torch.where(dead, fill, torch.softmax(s.masked_fill(dead, 0.0), dim=-1))


def _attention_backward(q: Tensor, k: Tensor, v: Tensor, p: Tensor, mask: Tensor | None,
                        out: Tensor, grad_out: Tensor, scale: float
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:math:`(\\bar Q, \\bar K, \\bar V, \\bar M)` of the module docstring from the
    probabilities ``p``, in differentiable ops (``create_graph=True`` records them)."""
    grad_v = torch.matmul(p.transpose(-2, -1), grad_out)
    grad_p = torch.matmul(grad_out, v.transpose(-2, -1))
    grad_s = p * (grad_p - (grad_out * out).sum(dim=-1, keepdim=True))
    grad_q = torch.matmul(grad_s, k) * scale
    grad_k = torch.matmul(grad_s.transpose(-2, -1), q) * scale
    grad_mask = None
    if mask is not None and mask.dtype != torch.bool and mask.requires_grad:
        grad_mask = grad_s.sum_to_size(mask.shape)
    return (grad_q.sum_to_size(q.shape), grad_k.sum_to_size(k.shape),
            grad_v.sum_to_size(v.shape), grad_mask)


def _attention_jvp(q: Tensor, k: Tensor, v: Tensor, p: Tensor, mask: Tensor | None,
                   tangents: tuple[Tensor | None, ...], scale: float) -> Tensor:
    r""":math:`\dot O` of the module docstring from the probabilities ``p`` and the tangents
    :math:`(\dot Q, \dot K, \dot V, \dot M)` (None: zero), in differentiable ops."""
    dq, dk, dv, dmask = tangents
    ds = torch.zeros_like(p)
    if dq is not None:
        ds = ds + torch.matmul(dq * scale, k.transpose(-2, -1))
    if dk is not None:
        ds = ds + torch.matmul(q * scale, dk.transpose(-2, -1))
    if dmask is not None and mask is not None and mask.dtype != torch.bool:
        ds = ds + dmask
    dp = p * (ds - (p * ds).sum(dim=-1, keepdim=True))
    dout = torch.matmul(dp, v)
    return dout if dv is None else dout + torch.matmul(p, dv)


class _Attention(torch.autograd.Function):
    """Fused forward; backward and forward-mode derivative (JVP) in differentiable ops
    (:func:`_attention_backward`, :func:`_attention_jvp`)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                scale: float | None) -> Tensor:
        return _FUSED(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        q, k, v, mask, is_causal, scale = inputs
        ctx.save_for_backward(q, k, v, mask, output)
        ctx.save_for_forward(q, k, v, mask, output)
        ctx.is_causal = is_causal
        # the kernels' default, 1 / sqrt(E), computed as they compute it
        ctx.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        ctx.probabilities = None

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, mask, out = ctx.saved_tensors
        p = ctx.probabilities
        if p is None:
            p = _scores(q, k, mask, ctx.is_causal, ctx.scale, out)
            if torch.is_grad_enabled():
                # create_graph: the gradient's graph holds p until the forward graph is freed
                # too, so the backward of the forward graph (the task loss's) reuses it
                ctx.probabilities = p
        return (*_attention_backward(q, k, v, p, mask, out, grad_out, ctx.scale), None, None)

    @staticmethod
    def jvp(ctx: Any, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None,
            dmask: Tensor | None, *_: Any) -> Tensor:
        q, k, v, mask, out = ctx.saved_tensors
        p = _scores(q, k, mask, ctx.is_causal, ctx.scale, out)
        return _attention_jvp(q, k, v, p, mask, (dq, dk, dv, dmask), ctx.scale)


def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` (same arguments, same output) whose gradient can be
    differentiated again (module docstring); a drop-in replacement."""
    tensors = (query, key, value) + (() if attn_mask is None else (attn_mask,))
    if any(t.is_nested for t in tensors):
        raise GradientError(
            "gradreg's differentiable attention does not take nested (ragged) tensors: pad the "
            "sequences and pass a boolean attn_mask (or key_padding_mask) instead.")
    if dropout_p > 0:  # MATH's dropout is differentiable; a fused kernel's mask is not kept
        with sdpa_kernel(SDPBackend.MATH):
            return _FUSED(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale,
                          **({"enable_gqa": True} if enable_gqa else {}))
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        if query.shape[-3] % key.shape[-3]:
            raise ValueError(
                f"enable_gqa needs the query heads ({query.shape[-3]}) to be a multiple of the "
                f"key/value heads ({key.shape[-3]}).")
        repeats = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeats, dim=-3)
        value = value.repeat_interleave(repeats, dim=-3)
    return _Attention.apply(query, key, value, attn_mask, is_causal, scale)


def explain_fused_attention(err: GradientError) -> GradientError:
    """``err`` (no double backward through the outputs' graph), with the fix where torch's
    message names a fused attention kernel: the forward belongs inside
    :func:`differentiable_attention`."""
    if "scaled_dot_product" not in str(err):
        return err
    return GradientError(
        f"{err} The model's attention ran a fused kernel, which has no double backward: compute "
        "the outputs inside `with gradreg.differentiable_attention():`, or pass the model itself "
        "(penalty(model, x)), which enters it.")


class _RouteAttention(TorchFunctionMode):
    """Replaces ``F.scaled_dot_product_attention`` by :func:`scaled_dot_product_attention`
    while active. ``F.multi_head_attention_forward`` dispatches to the mode as a whole (and
    runs its body with the mode off), so its call runs with the replacement in place of the
    fused entry point that its body calls (:func:`gradreg.torch_compat
    .attention_in_functional`)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _FUSED:
            return scaled_dot_product_attention(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            with attention_in_functional(scaled_dot_product_attention):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


_active = threading.local()


@contextmanager
def differentiable_attention() -> Iterator[None]:
    """Within this context, ``F.scaled_dot_product_attention`` (also as called by
    ``nn.MultiheadAttention`` and the transformer layers) is :func:`scaled_dot_product_attention`:
    the fused kernel forward, a backward that can be differentiated again. Wrap the forward
    whose graph a penalty differentiates::

        with gradreg.differentiable_attention():
            scores = critic(x)          # x = as_points(real)
        loss = adversarial(scores) + r1(scores, x)

    Nested uses are one context. The backward may run after the context is left."""
    if getattr(_active, "depth", 0):
        _active.depth += 1
        try:
            yield
        finally:
            _active.depth -= 1
        return
    _active.depth = 1
    try:
        with _RouteAttention():
            yield
    finally:
        _active.depth = 0
