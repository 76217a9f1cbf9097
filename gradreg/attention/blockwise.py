r"""Attention's derivatives up to second order, blockwise over queries and keys in memory linear
in the sequence (flash-attention style): no query x key tensor outlives one block.

Per head, for queries :math:`Q` (:math:`L \times E`), keys :math:`K` (:math:`S \times E`), values
:math:`V` (:math:`S \times E_v`), scale :math:`s` and additive mask :math:`M` (:math:`-\infty`
where a boolean mask or the causal mask forbids a key):

.. math::

    S = s\,QK^\top + M, \quad \ell = \operatorname{logsumexp}_{\text{row}}(S), \quad
    P = e^{S - \ell}, \quad O = PV.

The log-sum-exp :math:`\ell` (one number per query, :func:`log_sum_exp`) is all a block of
:math:`P` needs besides its own scores, so every block of :math:`P` is recomputed from :math:`Q`,
:math:`K`, :math:`M` and :math:`\ell`; row reductions over all keys are accumulated in a sweep over
the key blocks and column reductions (sums over queries) in the loop over query blocks. A query
whose keys are all masked gets :math:`\ell = +\infty` (:math:`P = 0`, the output 0 of torch >= 2.5's
kernels) or :math:`\ell =` NaN where the kernel's output there is NaN (torch 2.4).

First order, the vector-Jacobian product for an output cotangent :math:`G` (:func:`vjp`):

.. math::

    T = G V^\top, \quad D = \operatorname{rowsum}(G \odot O), \quad \bar S = P \odot (T - D),
    \quad \bar Q = s\,\bar S K, \quad \bar K = s\,\bar S^\top Q, \quad \bar V = P^\top G,
    \quad \bar M = \bar S.

The Jacobian-vector product for tangents :math:`\dot x = (\dot Q, \dot K, \dot V, \dot M)`
(:func:`jvp`):

.. math::

    \dot S = s(\dot Q K^\top + Q \dot K^\top) + \dot M, \quad
    \rho = \operatorname{rowsum}(P \odot \dot S), \quad
    \dot O = (P \odot \dot S) V - \rho\,O + P \dot V.

Second order (:func:`second_order`): the gradient w.r.t. :math:`x = (Q, K, V, M)` of
:math:`F = \langle G, \dot O(x; \dot x)\rangle = \langle \bar x(x; G), \dot x\rangle` (the
double backward differentiates :math:`\bar x` for cotangents :math:`\dot x = (u, w, z, m)` of
:math:`(\bar Q, \bar K, \bar V, \bar M)`; the backward of a JVP differentiates :math:`\dot O` for
a cotangent :math:`G`: the same function). With

.. math::

    \hat S = s(u K^\top + Q w^\top) + m, \quad r = \operatorname{rowsum}(P \odot \hat S), \quad
    c = \operatorname{rowsum}(\hat S \odot \bar S) - r D + \operatorname{rowsum}(G \odot P z),

    B = P \odot (\hat S - r), \quad
    C = \hat S \odot \bar S + P \odot (G z^\top - r\,T - c),

the gradients are

.. math::

    \partial_Q F = s(\bar S w + C K), \quad \partial_K F = s(\bar S^\top u + C^\top Q), \quad
    \partial_V F = B^\top G, \quad \partial_M F = C, \quad \partial_G F = B V + P z = \dot O.

Derivation: :math:`F = \langle \bar S, \hat S\rangle + \langle P, G z^\top\rangle` with
:math:`\bar S = P \odot (T - \operatorname{rowsum}(P \odot T))`; its differential in :math:`P`
and :math:`T` is :math:`\langle A, dP\rangle + \langle B, dT\rangle` with
:math:`A = \hat S \odot (T - D) - rT + Gz^\top`; :math:`T = GV^\top` gives the :math:`B` terms,
softmax's differential :math:`dP = P \odot (dS - \operatorname{rowsum}(P \odot dS))` turns
:math:`A` into :math:`C = P \odot (A - \operatorname{rowsum}(P \odot A))`, and the explicit
:math:`Q, K` in :math:`\hat S` give :math:`s\bar S w` and :math:`s\bar S^\top u`. The row
reductions :math:`D` (from :math:`O`), :math:`r`, :math:`c` and :math:`Pz` take a first sweep
over the key blocks, the gradients a second (one, with the first sweep's blocks kept, where the
keys fit one block). The blocks are batched matmuls over the batch and head dimensions.

float16 and bfloat16 inputs are computed in float32 (their sums over blocks would lose the
precision that one product accumulating in float32 keeps) and returned in their dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

__all__ = ["Attention", "jvp", "log_sum_exp", "second_order", "vjp"]

#: Queries per block: a block of scores is QUERY_BLOCK x KEY_BLOCK per head.
QUERY_BLOCK = 128
#: Keys per block; a sequence of up to this many keys takes one sweep per query block.
KEY_BLOCK = 512


#: Dtypes computed in float32: sums over blocks in them would lose what one product keeps.
_HALF = (torch.float16, torch.bfloat16)


def _cast(value: Any, source: torch.dtype, target: torch.dtype) -> Any:
    """``value`` (a tensor, None or nested tuples of them) with its ``source`` tensors in
    ``target``."""
    if isinstance(value, tuple):
        return tuple(_cast(x, source, target) for x in value)
    if isinstance(value, Tensor) and value.dtype == source:
        return value.to(target)
    return value


def _in_float32(keep: bool = False) -> Callable:
    """Runs a function of an :class:`Attention` in float32 where its queries are float16 or
    bfloat16, its results back in their dtype (in float32 where ``keep``)."""
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(a: Attention, *args: Any, **options: Any) -> Any:
            dtype = a.q.dtype
            if dtype not in _HALF:
                return fn(a, *args, **options)
            wide = replace(a, **{name: _cast(getattr(a, name), dtype, torch.float32)
                                 for name in ("q", "k", "v", "mask")})
            result = fn(wide, *_cast(args, dtype, torch.float32), **options)
            return result if keep else _cast(result, torch.float32, dtype)
        return run
    return decorate


def add_optional(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """``a + b``, None standing for zero."""
    if a is None:
        return b
    return a if b is None else a + b


@dataclass
class Attention:
    """One attention call: queries ``q`` [..., L, E], keys ``k`` [..., S, E], values ``v``
    [..., S, Ev] (the same leading dimensions), a boolean or additive ``mask`` broadcastable to
    [..., L, S], ``causal`` (top-left aligned), ``scale``; ``lse`` once computed."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None
    causal: bool
    scale: float
    query_block: int = field(default_factory=lambda: QUERY_BLOCK)
    key_block: int = field(default_factory=lambda: KEY_BLOCK)

    def rows(self) -> Iterator[slice]:
        n = self.q.shape[-2]
        return (slice(i, min(i + self.query_block, n)) for i in range(0, n, self.query_block))

    def columns(self, rows: slice) -> list[slice]:
        """The key blocks that query block ``rows`` sees (causal: none right of its last
        query)."""
        n = self.k.shape[-2]
        if self.causal:
            n = min(n, rows.stop)
        return [slice(j, min(j + self.key_block, n)) for j in range(0, n, self.key_block)]

    def mask_block(self, mask: Tensor, rows: slice, cols: slice) -> Tensor:
        """The block of a mask-shaped tensor (a dimension of size 1 broadcast)."""
        if mask.dim() >= 2 and mask.shape[-2] > 1:
            mask = mask[..., rows, :]
        return mask[..., cols] if mask.shape[-1] > 1 else mask

    def scores(self, rows: slice, cols: slice) -> Tensor:
        """:math:`S` on the block."""
        s = torch.matmul(self.q[..., rows, :] * self.scale, self.k[..., cols, :].transpose(-2, -1))
        if self.causal and cols.stop - 1 > rows.start:
            query = torch.arange(rows.start, rows.stop, device=s.device)[:, None]
            key = torch.arange(cols.start, cols.stop, device=s.device)
            s = s.masked_fill(key > query, float("-inf"))
        if self.mask is not None:
            m = self.mask_block(self.mask, rows, cols)
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        return s

    def probabilities(self, lse: Tensor, rows: slice, cols: slice) -> Tensor:
        """:math:`P = e^{S - \\ell}` on the block."""
        return self.scores(rows, cols).sub_(lse[..., rows, None]).exp_()  # a fresh tensor

    def tangent_scores(self, dq: Tensor | None, dk: Tensor | None, dm: Tensor | None,
                       rows: slice, cols: slice) -> Tensor | None:
        """:math:`s(\\dot Q K^\\top + Q \\dot K^\\top) + \\dot M` on the block (None: zero)."""
        pairs = [(x, y) for x, y in ((dq, self.k), (self.q, dk)) if x is not None and y is not None]
        ds = None
        if pairs:  # one product: [dQ, Q] [K, dK]^T = dQ K^T + Q dK^T
            left = torch.cat([x[..., rows, :] for x, _ in pairs], -1)
            right = torch.cat([y[..., cols, :] for _, y in pairs], -1)
            ds = torch.matmul(left * self.scale, right.transpose(-2, -1))
        if dm is not None:
            ds = add_optional(ds, self.mask_block(dm, rows, cols))
        return ds


@_in_float32(keep=True)
def log_sum_exp(a: Attention, out: Tensor) -> Tensor:
    """:math:`\\ell` [..., L] (float32 at least); :math:`+\\infty` on a query with no allowed
    key (NaN where the kernel's output ``out`` is NaN there)."""
    lse = torch.full(a.q.shape[:-1], float("-inf"), dtype=a.q.dtype, device=a.q.device)
    for rows in a.rows():
        for cols in a.columns(rows):
            lse[..., rows] = torch.logaddexp(lse[..., rows], a.scores(rows, cols).logsumexp(-1))
    dead = lse == float("-inf")
    fill = torch.where(out.isnan().any(dim=-1), float("nan"), float("inf")).to(lse.dtype)
    return torch.where(dead, fill, lse)


def _zeros_like_mask(a: Attention, wanted: bool) -> Tensor | None:
    return torch.zeros_like(a.mask) if wanted and a.mask is not None else None


@_in_float32()
def vjp(a: Attention, lse: Tensor, out: Tensor, g: Tensor, mask_grad: bool
        ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:math:`(\\bar Q, \\bar K, \\bar V, \\bar M)` for the output cotangent ``g`` (module
    docstring); :math:`\\bar M` [mask's shape] where ``mask_grad``."""
    d = (g * out).sum(-1, keepdim=True)
    gq, gk, gv = torch.zeros_like(a.q), torch.zeros_like(a.k), torch.zeros_like(a.v)
    gm = _zeros_like_mask(a, mask_grad)
    for rows in a.rows():
        for cols in a.columns(rows):
            p = a.probabilities(lse, rows, cols)
            ds = torch.matmul(g[..., rows, :], a.v[..., cols, :].transpose(-2, -1))
            ds = ds.sub_(d[..., rows, :]).mul_(p)
            gq[..., rows, :] += torch.matmul(ds, a.k[..., cols, :])
            gk[..., cols, :] += torch.matmul(ds.transpose(-2, -1), a.q[..., rows, :])
            gv[..., cols, :] += torch.matmul(p.transpose(-2, -1), g[..., rows, :])
            if gm is not None:
                _accumulate_mask(a, gm, ds, rows, cols)
    return gq * a.scale, gk * a.scale, gv, gm


def _accumulate_mask(a: Attention, gm: Tensor, block: Tensor, rows: slice, cols: slice) -> None:
    target = a.mask_block(gm, rows, cols)
    target += block.sum_to_size(target.shape)


@_in_float32()
def jvp(a: Attention, lse: Tensor, out: Tensor, dq: Tensor | None, dk: Tensor | None,
        dv: Tensor | None, dm: Tensor | None) -> Tensor:
    """:math:`\\dot O` for tangents (None: zero) of :math:`(Q, K, V, M)` (module docstring)."""
    acc = torch.zeros_like(out)
    rho = torch.zeros_like(out[..., :1])
    for rows in a.rows():
        for cols in a.columns(rows):
            p = a.probabilities(lse, rows, cols)
            ds = a.tangent_scores(dq, dk, dm, rows, cols)
            if ds is not None:
                pds = p * ds
                rho[..., rows, :] += pds.sum(-1, keepdim=True)
                acc[..., rows, :] += torch.matmul(pds, a.v[..., cols, :])
            if dv is not None:
                acc[..., rows, :] += torch.matmul(p, dv[..., cols, :])
    return acc - rho * out


@_in_float32()
def second_order(a: Attention, lse: Tensor, out: Tensor, g: Tensor,
                 cotangents: tuple[Tensor | None, ...], mask_grad: bool, with_vjp: bool
                 ) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor | None], Tensor,
                            tuple[Tensor, Tensor, Tensor, Tensor | None] | None]:
    """:math:`(\\partial_Q F, \\partial_K F, \\partial_V F, \\partial_M F)`, :math:`\\partial_G F`
    for ``cotangents`` :math:`(u, w, z, m)` (None: zero) and the output cotangent ``g``
    (module docstring), and, where ``with_vjp``, :func:`vjp` of ``g`` from the same blocks."""
    u, w, z, m = cotangents
    d = (g * out).sum(-1, keepdim=True)
    r, c = torch.zeros_like(d), torch.zeros_like(d)
    pz = None if z is None else torch.zeros_like(g)
    fq, fk, fv = torch.zeros_like(a.q), torch.zeros_like(a.k), torch.zeros_like(a.v)
    fg = torch.zeros_like(g)
    fm = _zeros_like_mask(a, mask_grad)
    first = None
    if with_vjp:
        first = (torch.zeros_like(a.q), torch.zeros_like(a.k), torch.zeros_like(a.v),
                 _zeros_like_mask(a, mask_grad))

    def block(rows: slice, cols: slice) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        p = a.probabilities(lse, rows, cols)
        t = torch.matmul(g[..., rows, :], a.v[..., cols, :].transpose(-2, -1))
        ds = (t - d[..., rows, :]).mul_(p)
        return p, t, ds, a.tangent_scores(u, w, m, rows, cols)

    for rows in a.rows():
        columns = a.columns(rows)
        kept = []
        for cols in columns:  # the row reductions r, rowsum(S^ . S-bar), P z
            p, t, ds, sh = blk = block(rows, cols)
            if sh is not None:
                r[..., rows, :] += (p * sh).sum(-1, keepdim=True)
                c[..., rows, :] += (sh * ds).sum(-1, keepdim=True)
            if pz is not None:
                pz[..., rows, :] += torch.matmul(p, z[..., cols, :])
            if len(columns) == 1:
                kept.append(blk)
        c[..., rows, :] -= r[..., rows, :] * d[..., rows, :]
        if pz is not None:
            c[..., rows, :] += (g[..., rows, :] * pz[..., rows, :]).sum(-1, keepdim=True)
        for cols in columns:
            p, t, ds, sh = kept.pop() if kept else block(rows, cols)
            gr, qr = g[..., rows, :], a.q[..., rows, :]
            inner = torch.addcmul(-c[..., rows, :], r[..., rows, :], t, value=-1)
            if z is not None:
                inner += torch.matmul(gr, z[..., cols, :].transpose(-2, -1))
            cc = inner.mul_(p) if sh is None else torch.addcmul(inner.mul_(p), sh, ds)
            fq[..., rows, :] += torch.matmul(cc, a.k[..., cols, :])
            fk[..., cols, :] += torch.matmul(cc.transpose(-2, -1), qr)
            if w is not None:
                fq[..., rows, :] += torch.matmul(ds, w[..., cols, :])
            if u is not None:
                fk[..., cols, :] += torch.matmul(ds.transpose(-2, -1), u[..., rows, :])
            if sh is not None:
                b = p * (sh - r[..., rows, :])
                fv[..., cols, :] += torch.matmul(b.transpose(-2, -1), gr)
                fg[..., rows, :] += torch.matmul(b, a.v[..., cols, :])
            if fm is not None:
                _accumulate_mask(a, fm, cc, rows, cols)
            if first is not None:
                first[0][..., rows, :] += torch.matmul(ds, a.k[..., cols, :])
                first[1][..., cols, :] += torch.matmul(ds.transpose(-2, -1), qr)
                first[2][..., cols, :] += torch.matmul(p.transpose(-2, -1), gr)
                if first[3] is not None:
                    _accumulate_mask(a, first[3], ds, rows, cols)
    if pz is not None:
        fg += pz
    if first is not None:
        first = (first[0] * a.scale, first[1] * a.scale, first[2], first[3])
    return (fq * a.scale, fk * a.scale, fv, fm), fg, first
