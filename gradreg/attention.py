r"""Scaled dot-product attention with a double backward, for exact penalties through attention.

Only the MATH backend of ``F.scaled_dot_product_attention`` has a double backward; the fused
kernels (flash, memory-efficient, CPU flash) have none, so an exact penalty (R1, WGAN-GP, double
backprop, ``param_grad_norm``) through ``nn.MultiheadAttention``, ``nn.TransformerEncoder`` or a
ViT fails in its double backward. :func:`scaled_dot_product_attention` is an autograd function
whose forward is the fused kernel (the backend the caller's ``sdpa_kernel`` context chose) and
whose backward can be differentiated again (a gradient taken with ``create_graph=True``
through it has a graph) and which has a forward-mode derivative. For queries :math:`Q`, keys
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

computed blockwise over queries and keys (:mod:`gradreg.blockwise_attention`, which also
derives the double backward): every block of :math:`P` is recomputed from :math:`Q, K, M` and the
log-sum-exp of each query's scores (computed once per forward, in a sweep of the same blocks), so
no :math:`L \times S` tensor is kept between the passes or built in one; memory grows linearly
with the sequence, as the fused kernel's forward does. The backward taken with
``create_graph=True`` is itself an autograd function (:class:`_AttentionGrad`) whose backward,
the double backward, is blockwise; so is the backward of the JVP (:class:`_AttentionJvp`, the
spectral norm's). A row whose keys are all masked has :math:`P = 0` where the kernel's output
there is 0 (torch 2.13, 2.14) and :math:`P =` NaN where it is NaN (torch 2.4): the derivatives
are those of the forward that ran. Derivatives of third order (the double backward
differentiated again, the JVP of a JVP of the exact Hessian penalty, and its backward) are
written in differentiable ops on :math:`L \times S` tensors, as MATH's are.

:func:`differentiable_attention` routes every ``F.scaled_dot_product_attention`` call made while
it is active (``nn.MultiheadAttention`` and the ``nn.TransformerEncoder`` layers in train and eval
mode, timm's ViT with ``fused_attn``, Hugging Face models with ``attn_implementation="sdpa"``)
through :func:`scaled_dot_product_attention`. Wrap it around the forward whose graph a penalty
differentiates, and only that forward: a task loss without a penalty keeps the fused backward.
A penalty called with the model itself (``penalty(D, x)``) by an exact method enters it by itself.

``dropout_p > 0`` (attention dropout in training mode) runs the MATH backend for that call: the
dropout mask of a fused kernel cannot be recovered for the backward, and MATH's dropout is an
ordinary differentiable op, so the result equals a model with MATH attention everywhere (the same
random numbers), at MATH's memory (quadratic in the sequence). ``enable_gqa`` (torch >= 2.5)
repeats the key and value heads before the kernel. Nested (ragged) tensors are refused.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from gradreg import blockwise_attention as blockwise
from gradreg.autograd import GradientError
from gradreg.blockwise_attention import add_optional
from gradreg.torch_compat import attention_in_functional, functorch_transform_active

__all__ = ["BACKENDS", "differentiable_attention", "explain_fused_attention",
           "scaled_dot_product_attention"]

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


def _reference_vjp(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Tensor,
                   out: Tensor, is_causal: bool, scale: float) -> tuple[Tensor | None, ...]:
    r""":math:`(\bar Q, \bar K, \bar V, \bar M)` of the module docstring in differentiable ops
    on :math:`L \times S` tensors: the derivatives of third order differentiate it."""
    p = _scores(q, k, mask, is_causal, scale, out)
    grad_s = p * (torch.matmul(g, v.transpose(-2, -1)) - (g * out).sum(dim=-1, keepdim=True))
    grad_mask = None
    if mask is not None and mask.dtype != torch.bool:
        grad_mask = grad_s.sum_to_size(mask.shape)
    return (torch.matmul(grad_s, k) * scale, torch.matmul(grad_s.transpose(-2, -1), q) * scale,
            torch.matmul(p.transpose(-2, -1), g), grad_mask)


def _tangent_scores(q: Tensor, k: Tensor, tangents: tuple[Tensor | None, ...], scale: float
                    ) -> Tensor | None:
    r""":math:`\dot S = s(\dot Q K^\top + Q \dot K^\top) + \dot M` (None: zero)."""
    dq, dk, _, dm = tangents
    ds = None if dq is None else torch.matmul(dq * scale, k.transpose(-2, -1))
    if dk is not None:
        ds = add_optional(ds, torch.matmul(q * scale, dk.transpose(-2, -1)))
    return add_optional(ds, dm)


def _softmax_jvp(p: Tensor, ds: Tensor | None) -> Tensor | None:
    r""":math:`\dot P = P \odot (\dot S - \operatorname{rowsum}(P \odot \dot S))`."""
    return None if ds is None else p * (ds - (p * ds).sum(dim=-1, keepdim=True))


def _matmul(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return None if a is None or b is None else torch.matmul(a, b)


def _reference_jvp(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor,
                   tangents: tuple[Tensor | None, ...], is_causal: bool, scale: float) -> Tensor:
    r""":math:`\dot O = \dot P V + P \dot V` in differentiable ops on :math:`L \times S`
    tensors (the third-order derivatives differentiate it)."""
    p = _scores(q, k, mask, is_causal, scale, out)
    dout = add_optional(_matmul(_softmax_jvp(p, _tangent_scores(q, k, tangents, scale)), v),
                _matmul(p, tangents[2]))
    return torch.zeros_like(out) if dout is None else dout


def _jvp_of_jvp(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor,
                tangents: tuple[Tensor | None, ...], second: tuple[Tensor | None, ...],
                of_tangents: tuple[Tensor | None, ...], is_causal: bool, scale: float) -> Tensor:
    r"""The derivative of :math:`\dot O(x; \dot x)` along :math:`(\tilde x, \tilde{\dot x})`
    (``second``, ``of_tangents``): :math:`\dot O(x; \tilde{\dot x}) + \ddot P V + \dot P
    \tilde V + \tilde P \dot V` with :math:`\ddot P = \tilde P \odot (\dot S - \rho) + P \odot
    (\ddot S - \operatorname{rowsum}(\tilde P \odot \dot S + P \odot \ddot S))`, :math:`\ddot S
    = s(\dot Q \tilde K^\top + \tilde Q \dot K^\top)`; in differentiable ops on
    :math:`L \times S` tensors (the exact Hessian penalty differentiates it)."""
    p = _scores(q, k, mask, is_causal, scale, out)
    dq, dk, dv, _ = tangents
    s_dot, s_tilde = _tangent_scores(q, k, tangents, scale), _tangent_scores(q, k, second, scale)
    s_ddot = None
    if dq is not None and second[1] is not None:
        s_ddot = torch.matmul(dq * scale, second[1].transpose(-2, -1))
    if dk is not None and second[0] is not None:
        s_ddot = add_optional(s_ddot, torch.matmul(second[0] * scale, dk.transpose(-2, -1)))
    p_dot, p_tilde = _softmax_jvp(p, s_dot), _softmax_jvp(p, s_tilde)
    p_ddot = _softmax_jvp(p, s_ddot)
    if p_tilde is not None and s_dot is not None:
        rho = (p * s_dot).sum(dim=-1, keepdim=True)
        cross = (p_tilde * s_dot).sum(dim=-1, keepdim=True)
        p_ddot = add_optional(p_ddot, p_tilde * (s_dot - rho) - p * cross)
    result = _reference_jvp(q, k, v, mask, out, of_tangents, is_causal, scale)
    for a, b in ((p_ddot, v), (p_dot, second[2]), (p_tilde, dv)):
        product = _matmul(a, b)
        if product is not None:
            result = result + product
    return result


def _differentiate(fn: Callable[..., tuple[Tensor | None, ...]], inputs: tuple,
                   cotangents: tuple[Tensor | None, ...]) -> list[Tensor | None]:
    r"""The gradients of :math:`\sum_i \langle fn(inputs)_i, cotangents_i\rangle` w.r.t. the
    tensors of ``inputs`` that require grad (None for the rest), with their graph."""
    wanted = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]
    with torch.enable_grad():
        pairs = [(o, c) for o, c in zip(fn(*inputs), cotangents, strict=True)
                 if o is not None and c is not None and o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted],
                                    [c for _, c in pairs], create_graph=True,
                                    allow_unused=True) if pairs and wanted else ()
    result: list[Tensor | None] = [None] * len(inputs)
    for i, grad in zip(wanted, grads, strict=False):
        result[i] = grad
    return result


def _learned(mask: Tensor | None) -> bool:
    return mask is not None and mask.dtype != torch.bool


def _default_scale(q: Tensor, scale: float | None) -> float:
    """The kernels' default, 1 / sqrt(E), computed as they compute it."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


class _Attention(torch.autograd.Function):
    """The forward of ``kernels`` (:mod:`gradreg.blockwise_attention`: the fused kernel; the
    Triton kernels of :mod:`gradreg.triton_attention`: theirs, which returns the log-sum-exp
    too, as a second output that is not differentiable); backward (:class:`_AttentionGrad`) and
    forward-mode derivative (:class:`_AttentionJvp`) by ``kernels``."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                scale: float | None, kernels: Any) -> Tensor | tuple[Tensor, Tensor]:
        if kernels is blockwise:
            return _FUSED(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
        return kernels.forward(blockwise.Attention(q, k, v, mask, is_causal,
                                                   _default_scale(q, scale)))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor | tuple[Tensor, Tensor]) -> None:
        q, k, v, mask, is_causal, scale, kernels = inputs
        ctx.lse = None
        if isinstance(output, tuple):
            output, ctx.lse = output
            ctx.mark_non_differentiable(ctx.lse)
        ctx.save_for_backward(q, k, v, mask, output)
        ctx.save_for_forward(q, k, v, mask, output)
        ctx.is_causal, ctx.kernels = is_causal, kernels
        ctx.scale = _default_scale(q, scale)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        q, k, v, mask, out = ctx.saved_tensors
        lse = _log_sum_exp(ctx, q, k, v, mask, out)
        mask_grad = _learned(mask) and ctx.needs_input_grad[3]
        if torch.is_grad_enabled():  # create_graph: a Function whose backward is blockwise
            grads = _AttentionGrad.apply(q, k, v, mask, grad_out, out, lse, ctx.is_causal,
                                         ctx.scale, mask_grad, ctx.kernels)
        else:
            problem = blockwise.Attention(q, k, v, mask, ctx.is_causal, ctx.scale)
            grads = ctx.kernels.vjp(problem, lse, out, grad_out, mask_grad)
        return (*grads[:3], grads[3] if mask_grad else None, None, None, None)

    @staticmethod
    def jvp(ctx: Any, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None,
            dmask: Tensor | None, *_: Any) -> Tensor | tuple[Tensor, None]:
        q, k, v, mask, out = ctx.saved_tensors
        lse = _log_sum_exp(ctx, q, k, v, mask, out)
        dout = _AttentionJvp.apply(q, k, v, mask, out, lse, ctx.is_causal, ctx.scale,
                                   ctx.kernels, dq, dk, dv, dmask if _learned(mask) else None)
        return dout if ctx.kernels is blockwise else (dout, None)


def _log_sum_exp(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor
                 ) -> Tensor:
    """The forward's log-sum-exp per query: the Triton forward's, else computed once per forward
    (blockwise)."""
    if ctx.lse is None:
        with torch.no_grad():
            problem = blockwise.Attention(q.detach(), k.detach(), v.detach(), None if mask is None
                                          else mask.detach(), ctx.is_causal, ctx.scale)
            ctx.lse = blockwise.log_sum_exp(problem, out.detach())
    return ctx.lse


class _AttentionGrad(torch.autograd.Function):
    r""":math:`(\bar Q, \bar K, \bar V[, \bar M])` of :math:`(Q, K, V, M, \bar O)`
    (:func:`blockwise_attention.vjp`); its backward is :func:`blockwise_attention.second_order`
    (the double backward; in differentiable ops on :math:`L \times S` tensors where that
    backward is itself differentiated), both by ``kernels`` (the blockwise path's functions or
    the Triton kernels')."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Tensor, out: Tensor,
                lse: Tensor, is_causal: bool, scale: float, mask_grad: bool,
                kernels: Any) -> tuple[Tensor, ...]:
        grads = kernels.vjp(blockwise.Attention(q, k, v, mask, is_causal, scale), lse, out, g,
                            mask_grad)
        return grads if mask_grad else grads[:3]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, mask, g, out, lse, is_causal, scale, _, kernels = inputs
        ctx.save_for_backward(q, k, v, mask, g, out, lse)
        ctx.is_causal, ctx.scale, ctx.kernels = is_causal, scale, kernels
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, mask, g, out, lse = ctx.saved_tensors
        cotangents = (*cotangents, None)[:4]
        if torch.is_grad_enabled():
            grads = _differentiate(
                lambda *x: _reference_vjp(*x, out, ctx.is_causal, ctx.scale),
                (q, k, v, mask, g), cotangents)
            return (*grads, None, None, None, None, None, None)
        mask_grad = _learned(mask) and ctx.needs_input_grad[3]
        problem = blockwise.Attention(q, k, v, mask, ctx.is_causal, ctx.scale)
        (fq, fk, fv, fm), fg, _ = ctx.kernels.second_order(problem, lse, out, g, cotangents,
                                                           mask_grad, with_vjp=False)
        return fq, fk, fv, fm, fg, None, None, None, None, None, None



class _AttentionJvp(torch.autograd.Function):
    r""":math:`\dot O` of :math:`(Q, K, V, M)` and tangents :math:`(\dot Q, \dot K, \dot V,
    \dot M)` (:func:`blockwise_attention.jvp`); its backward is
    :func:`blockwise_attention.second_order` with :func:`blockwise_attention.vjp` for the
    tangents, its own JVP (the exact Hessian penalty's JVP of a JVP) :func:`_jvp_of_jvp`; all
    but the last by ``kernels``."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, lse: Tensor,
                is_causal: bool, scale: float, kernels: Any, *tangents: Tensor | None) -> Tensor:
        return kernels.jvp(blockwise.Attention(q, k, v, mask, is_causal, scale), lse, out,
                           *tangents)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        q, k, v, mask, out, lse, is_causal, scale, kernels, *tangents = inputs
        ctx.save_for_backward(q, k, v, mask, out, lse, *tangents)
        ctx.save_for_forward(q, k, v, mask, out, *tangents)
        ctx.is_causal, ctx.scale, ctx.kernels = is_causal, scale, kernels
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, y: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, mask, out, lse, *tangents = ctx.saved_tensors
        if y is None:
            return (None,) * 13
        if torch.is_grad_enabled():
            grads = _differentiate(
                lambda q, k, v, mask, *t: (_reference_jvp(q, k, v, mask, out, t, ctx.is_causal,
                                                          ctx.scale),),
                (q, k, v, mask, *tangents), (y,))
            return (*grads[:4], None, None, None, None, None, *grads[4:])
        need = ctx.needs_input_grad
        problem = blockwise.Attention(q, k, v, mask, ctx.is_causal, ctx.scale)
        mask_grad = _learned(mask) and (need[3] or need[12])
        (fq, fk, fv, fm), _, first = ctx.kernels.second_order(
            problem, lse, out, y, tuple(tangents), mask_grad, with_vjp=any(need[9:]))
        first = first or (None,) * 4
        return (fq, fk, fv, fm if need[3] else None, None, None, None, None, None,
                *(f if n else None for f, n in zip(first, need[9:], strict=True)))

    @staticmethod
    def jvp(ctx: Any, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None,
            dmask: Tensor | None, _out: Any, _lse: Any, _causal: Any, _scale: Any,
            _kernels: Any, *of_tangents: Tensor | None) -> Tensor:
        q, k, v, mask, out, *tangents = ctx.saved_tensors
        return _jvp_of_jvp(q, k, v, mask, out, tuple(tangents), (dq, dk, dv, dmask),
                           tuple(of_tangents), ctx.is_causal, ctx.scale)


#: The backends of :func:`differentiable_attention`: ``"auto"`` is ``"blockwise"`` (the Triton
#: kernels are checked in Triton's interpreter only, not yet run on a GPU: asked for by name).
BACKENDS = ("auto", "blockwise", "triton")


def _kernels(backend: str, query: Tensor) -> Any:
    """The module whose functions compute the derivatives (and, for Triton, the forward):
    ``"auto"`` takes the blockwise path."""
    if backend == "triton":
        if query.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise GradientError(
                f"backend='triton' runs its kernels on CUDA tensors, got {query.device.type} "
                "ones: move the model to a GPU, or use backend='blockwise' (on the CPU, Triton's "
                "interpreter runs them where TRITON_INTERPRET=1 is set before gradreg imports "
                "them).")
        return _triton_kernels()
    return blockwise


def _triton_kernels() -> Any:
    """:mod:`gradreg.triton_attention`; a clear error where Triton is not installed (or too
    old)."""
    try:
        from gradreg import triton_attention
    except ImportError as err:
        raise GradientError(
            f"backend='triton' needs Triton ({err}): pip install 'gradreg[triton]', or use "
            "backend='blockwise'.") from err
    return triton_attention


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; valid: "
                         f"{', '.join(map(repr, BACKENDS))}.")


def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
    enable_gqa: bool = False, *, backend: str | None = None,
) -> Tensor:
    """``F.scaled_dot_product_attention`` (same arguments, same output) whose gradient can be
    differentiated again (module docstring); a drop-in replacement. ``backend``: one of
    :data:`BACKENDS`, that of the enclosing :func:`differentiable_attention` where None
    (``"auto"`` outside one)."""
    backend = getattr(_active, "backend", "auto") if backend is None else backend
    _check_backend(backend)
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
    if functorch_transform_active():  # torch.func differentiates ops, not these Functions
        return _reference_attention(query, key, value, attn_mask, is_causal, scale)
    kernels = _kernels(backend, query)
    out = _Attention.apply(query, key, value, attn_mask, is_causal, scale, kernels)
    return out if kernels is blockwise else out[0]


def _reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                         scale: float | None) -> Tensor:
    r""":math:`O = P V` in differentiable ops on :math:`L \times S` tensors, a row whose keys are
    all masked as the fused kernel has it (:func:`_scores`): for ``torch.func`` transforms (grad
    of grad, jvp or vjp of grad), which differentiate ops as they run rather than the autograd
    Functions of the fused path."""
    out = _FUSED(q.detach(), k.detach(), v.detach(), is_causal=is_causal, scale=scale,
                 attn_mask=None if mask is None else mask.detach())  # where rows are dead
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.matmul(_scores(q, k, mask, is_causal, scale, out), v)


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
def differentiable_attention(backend: str | None = None) -> Iterator[None]:
    """Within this context, ``F.scaled_dot_product_attention`` (also as called by
    ``nn.MultiheadAttention`` and the transformer layers) is :func:`scaled_dot_product_attention`:
    the fused kernel forward, a backward that can be differentiated again. Wrap the forward
    whose graph a penalty differentiates::

        with gradreg.differentiable_attention():
            scores = critic(x)          # x = as_points(real)
        loss = adversarial(scores) + r1(scores, x)

    ``backend`` (:data:`BACKENDS`): ``"blockwise"``, the fused kernel's forward and the
    derivatives of :mod:`gradreg.blockwise_attention`; ``"triton"``, the forward and the
    derivatives as Triton kernels (:mod:`gradreg.triton_attention`; ``pip install
    'gradreg[triton]'``), on CUDA tensors, checked in Triton's interpreter but not yet run on a
    GPU; ``"auto"`` (the default, None): ``"blockwise"``. Nested uses are one context (an
    inner one given a backend uses it until it is left). The backward may run after the context
    is left, with the backend of the forward."""
    if backend is not None:
        _check_backend(backend)
        if backend == "triton":
            _triton_kernels()  # refused here where Triton is not installed
        outer = getattr(_active, "backend", "auto")
        _active.backend = backend
        try:
            with differentiable_attention():
                yield
        finally:
            _active.backend = outer
        return
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
