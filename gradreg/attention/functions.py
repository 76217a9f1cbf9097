r"""Attention as autograd functions whose backward can be differentiated again, and which have a
forward-mode derivative, given the module of kernels that computes them
(:mod:`gradreg.attention.blockwise` or :mod:`gradreg.attention.triton`). For queries :math:`Q`, keys
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

computed blockwise over queries and keys (:mod:`gradreg.attention.blockwise`, which also derives
the double backward): every block of :math:`P` is recomputed from :math:`Q, K, M` and the
log-sum-exp of each query's scores (computed once per forward, in a sweep of the same blocks), so no
:math:`L \times S` tensor is kept between the passes or built in one; memory grows linearly with the
sequence, as the fused kernel's forward does. The backward taken with ``create_graph=True`` is
itself an autograd function (:class:`_AttentionGrad`) whose backward, the double backward, is
blockwise; so is the backward of the JVP (:class:`_AttentionJvp`, the spectral norm's). A row whose
keys are all masked has :math:`P = 0` where the kernel's output there is 0 (torch 2.13, 2.14) and
:math:`P =` NaN where it is NaN (torch 2.4): the derivatives are those of the forward that ran.
Derivatives of third order (the double backward differentiated again, the JVP of a JVP of the exact
Hessian penalty, and its backward) are written in differentiable ops on :math:`L \times S` tensors,
as MATH's are (:func:`reference_attention` is the forward in them, for ``torch.func`` transforms).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gradreg.attention import blockwise
from gradreg.attention.blockwise import add_optional

__all__ = ["FUSED", "attention", "reference_attention"]

#: The fused entry point that :func:`~gradreg.attention.differentiable_attention` replaces (bound
#: at import, so a replacement of the module attribute never reaches it).
FUSED = F.scaled_dot_product_attention


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
    """The forward of ``kernels`` (:mod:`gradreg.attention.blockwise`: the fused kernel; the Triton
    kernels of :mod:`gradreg.attention.triton`: theirs, which returns the log-sum-exp too, as a
    second output that is not differentiable); backward (:class:`_AttentionGrad`) and forward-mode
    derivative (:class:`_AttentionJvp`) by ``kernels``."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                scale: float | None, kernels: Any) -> Tensor | tuple[Tensor, Tensor]:
        if kernels is blockwise:
            return FUSED(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
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
    (:func:`gradreg.attention.blockwise.vjp`); its backward is
    :func:`gradreg.attention.blockwise.second_order` (the double backward; in differentiable ops on
    :math:`L \times S` tensors where that backward is itself differentiated), both by ``kernels``
    (the blockwise path's functions or the Triton kernels')."""

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
    r""":math:`\dot O` of :math:`(Q, K, V, M)` and tangents :math:`(\dot Q, \dot K, \dot V, \dot M)`
    (:func:`gradreg.attention.blockwise.jvp`); its backward is
    :func:`gradreg.attention.blockwise.second_order` with :func:`gradreg.attention.blockwise.vjp`
    for the tangents, its own JVP (the exact Hessian penalty's JVP of a JVP) :func:`_jvp_of_jvp`;
    all but the last by ``kernels``."""

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


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
              scale: float | None, kernels: Any) -> Tensor:
    """:math:`O` of the module docstring, its derivatives (and, for the Triton kernels, itself)
    by ``kernels``: :mod:`gradreg.attention.blockwise` or :mod:`gradreg.attention.triton`."""
    out = _Attention.apply(q, k, v, mask, is_causal, scale, kernels)
    return out if kernels is blockwise else out[0]


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                        scale: float | None) -> Tensor:
    r""":math:`O = P V` in differentiable ops on :math:`L \times S` tensors, a row whose keys are
    all masked as the fused kernel has it (:func:`_scores`): for ``torch.func`` transforms (grad
    of grad, jvp or vjp of grad), which differentiate ops as they run rather than the autograd
    Functions of the fused path."""
    out = FUSED(q.detach(), k.detach(), v.detach(), is_causal=is_causal, scale=scale,
                 attn_mask=None if mask is None else mask.detach())  # where rows are dead
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.matmul(_scores(q, k, mask, is_causal, scale, out), v)
