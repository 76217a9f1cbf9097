r"""Attention's forward, backward, double backward and JVP as Triton kernels, flash-style.

The same functions as :mod:`gradreg.attention.blockwise` (whose docstring derives the math), of
the same :class:`~gradreg.attention.blockwise.Attention`, computed by four kernels that keep
each block of scores in registers: no :math:`L \times S` tensor is built, memory is linear in the
sequence, and the log-sum-exp :math:`\ell` of each query is what a block of :math:`P` is
recomputed from.

* :func:`forward`: :math:`O` and :math:`\ell` in one sweep over the key blocks per query block
  (the online softmax); a query whose keys are all masked gets :math:`O = 0`,
  :math:`\ell = +\infty`.
* ``_row_sums``: per query block, a sweep over the key blocks for the row reductions of
  :math:`\hat S` (a tangent of the scores): :math:`r = \operatorname{rowsum}(P \odot \hat S)`,
  :math:`(P \odot \hat S) V`, :math:`P z` and :math:`\operatorname{rowsum}(\hat S \odot \bar S)`.
  The JVP is :math:`\dot O = (P \odot \dot S) V + P \dot V - \rho\,O` of it
  (:math:`\hat S = \dot S`, :math:`z = \dot V`); the double backward's first sweep is it.
* ``_query_side`` (per query block, over the key blocks) and ``_key_side`` (per key block, over
  the query blocks): the gradients of the backward (:math:`\bar Q`; :math:`\bar K, \bar V`) and
  of the double backward (:math:`\partial_Q F, \partial_G F`; :math:`\partial_K F,
  \partial_V F`), each accumulated by the one program that owns its rows (no atomics). The
  gradient of a learned additive mask is written tile by tile into an :math:`L \times S` tensor
  per batch and head, then summed over the mask's broadcast dimensions: memory quadratic in the
  sequence, and more than the mask's own where it is broadcast (the blockwise path sums each
  block into the mask's shape).

Computed in the inputs' dtype where it is float32 (IEEE products, no TF32) or float64, in float32
for float16 and bfloat16 (as the blockwise path). The kernels run on CUDA tensors, and on CPU
tensors under Triton's interpreter (``TRITON_INTERPRET=1``), where the tests check them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from gradreg.attention.blockwise import Attention, _in_float32

#: The oldest Triton the kernels are written for (float64 ``tl.dot``, ``input_precision``).
MIN_TRITON = (3, 2)
if tuple(int(part) for part in triton.__version__.split(".")[:2]) < MIN_TRITON:
    raise ImportError(f"the attention kernels need triton>=3.2, found {triton.__version__}")

__all__ = ["BLOCK", "MIN_TRITON", "forward", "jvp", "second_order", "vjp"]

#: Queries and keys per block (a block of scores is BLOCK x BLOCK per head); None: chosen per
#: call by :func:`block_size`.
BLOCK: int | None = None

_NONE, _BOOL, _ADDITIVE = 0, 1, 2


@triton.jit
def _tile(ptr, rows, cols, n_rows, n_cols, stride_row, stride_col):
    """The [rows, cols] tile of a matrix, 0 outside it."""
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, mask=inside,
                   other=0.0)


@triton.jit
def _put(ptr, value, rows, cols, n_rows, n_cols, stride_row):
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(ptr + rows[:, None] * stride_row + cols[None, :], value, mask=inside)


@triton.jit
def _scores(q, k, mask_ptr, rows, cols, L, S, scale, stride_ml, stride_ms,
            CAUSAL: tl.constexpr, MASK: tl.constexpr):
    """:math:`S = s\\,QK^\\top + M` on the block; -inf outside the keys, right of the diagonal
    (causal) and where a boolean mask forbids a key."""
    s = tl.dot(q * scale, tl.trans(k), input_precision="ieee")
    allowed = cols[None, :] < S
    if CAUSAL:
        allowed = allowed & (cols[None, :] <= rows[:, None])
    if MASK == 1:
        m = _tile(mask_ptr, rows, cols, L, S, stride_ml, stride_ms)
        allowed = allowed & (m != 0)
    if MASK == 2:
        s += _tile(mask_ptr, rows, cols, L, S, stride_ml, stride_ms)
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _tangent(q, k, u_ptr, w_ptr, m_ptr, rows, cols, es, L, S, E, scale, stride_ml, stride_ms,
             HAS_U: tl.constexpr, HAS_W: tl.constexpr, HAS_M: tl.constexpr):
    """:math:`\\hat S = s(u K^\\top + Q w^\\top) + m` on the block (u: [L, E], w: [S, E],
    m: the mask's layout)."""
    sh = tl.zeros([rows.shape[0], cols.shape[0]], dtype=q.dtype)
    if HAS_U:
        u = _tile(u_ptr, rows, es, L, E, E, 1)
        sh += tl.dot(u * scale, tl.trans(k), input_precision="ieee")
    if HAS_W:
        w = _tile(w_ptr, cols, es, S, E, E, 1)
        sh += tl.dot(q * scale, tl.trans(w), input_precision="ieee")
    if HAS_M:
        sh += _tile(m_ptr, rows, cols, L, S, stride_ml, stride_ms)
    return sh


@triton.jit
def _forward_kernel(Q, K, V, MASK, OUT, LSE, L, S, E, EV, H, scale,
                    smb, smh, sml, sms, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, BEV: tl.constexpr):
    n = tl.program_id(1).to(tl.int64)  # offsets of N x L x S elements pass 2**31
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    es, evs = tl.arange(0, BE), tl.arange(0, BEV)
    mask = MASK + (n // H) * smb + (n % H) * smh
    q = _tile(Q + n * L * E, rows, es, L, E, E, 1)
    top = tl.full([BM], float("-inf"), dtype=q.dtype)
    total = tl.zeros([BM], dtype=q.dtype)
    acc = tl.zeros([BM, BEV], dtype=q.dtype)
    end = S
    if CAUSAL:
        end = tl.minimum(S, (tl.program_id(0) + 1) * BM)
    for start in range(0, end, BN):
        cols = start + tl.arange(0, BN)
        k = _tile(K + n * S * E, cols, es, S, E, E, 1)
        v = _tile(V + n * S * EV, cols, evs, S, EV, EV, 1)
        s = _scores(q, k, mask, rows, cols, L, S, scale, sml, sms, CAUSAL, MASK_KIND)
        new = tl.maximum(top, tl.max(s, 1))
        shift = tl.where(new == float("-inf"), 0.0, new)
        p = tl.exp(s - shift[:, None])
        decay = tl.exp(top - shift)
        total = total * decay + tl.sum(p, 1)
        acc = acc * decay[:, None] + tl.dot(p, v, input_precision="ieee")
        top = new
    alive = total > 0
    out = acc / tl.where(alive, total, 1.0)[:, None]
    lse = tl.where(alive, top + tl.log(tl.where(alive, total, 1.0)), float("inf"))
    _put(OUT + n * L * EV, out, rows, evs, L, EV, EV)
    tl.store(LSE + n * L + rows, lse, mask=rows < L)


@triton.jit
def _row_sums_kernel(Q, K, V, MASK, LSE, G, D, U, W, TM, Z,
                     R, C, PSV, PZ, L, S, E, EV, H, scale, smb, smh, sml, sms,
                     CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_U: tl.constexpr,
                     HAS_W: tl.constexpr, HAS_M: tl.constexpr, HAS_Z: tl.constexpr,
                     WANT_C: tl.constexpr, WANT_PSV: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, BEV: tl.constexpr):
    """Per query block: r, rowsum(S^ . S-bar) (WANT_C), (P . S^) V (WANT_PSV), P z (HAS_Z)."""
    n = tl.program_id(1).to(tl.int64)  # offsets of N x L x S elements pass 2**31
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    es, evs = tl.arange(0, BE), tl.arange(0, BEV)
    offset = (n // H) * smb + (n % H) * smh
    q = _tile(Q + n * L * E, rows, es, L, E, E, 1)
    lse = tl.load(LSE + n * L + rows, mask=rows < L, other=float("inf"))
    r = tl.zeros([BM], dtype=q.dtype)
    c = tl.zeros([BM], dtype=q.dtype)
    psv = tl.zeros([BM, BEV], dtype=q.dtype)
    pz = tl.zeros([BM, BEV], dtype=q.dtype)
    if WANT_C:
        g = _tile(G + n * L * EV, rows, evs, L, EV, EV, 1)
        d = tl.load(D + n * L + rows, mask=rows < L, other=0.0)
    end = S
    if CAUSAL:
        end = tl.minimum(S, (tl.program_id(0) + 1) * BM)
    for start in range(0, end, BN):
        cols = start + tl.arange(0, BN)
        k = _tile(K + n * S * E, cols, es, S, E, E, 1)
        s = _scores(q, k, MASK + offset, rows, cols, L, S, scale, sml, sms, CAUSAL, MASK_KIND)
        p = tl.exp(s - lse[:, None])
        if HAS_U or HAS_W or HAS_M:
            sh = _tangent(q, k, U + n * L * E, W + n * S * E, TM + offset, rows, cols, es, L, S,
                          E, scale, sml, sms, HAS_U, HAS_W, HAS_M)
            ps = p * sh
            r += tl.sum(ps, 1)
            if WANT_PSV:
                v = _tile(V + n * S * EV, cols, evs, S, EV, EV, 1)
                psv += tl.dot(ps, v, input_precision="ieee")
            if WANT_C:
                v = _tile(V + n * S * EV, cols, evs, S, EV, EV, 1)
                t = tl.dot(g, tl.trans(v), input_precision="ieee")
                c += tl.sum(sh * (p * (t - d[:, None])), 1)
        if HAS_Z:
            z = _tile(Z + n * S * EV, cols, evs, S, EV, EV, 1)
            pz += tl.dot(p, z, input_precision="ieee")
    tl.store(R + n * L + rows, r, mask=rows < L)
    if WANT_C:
        tl.store(C + n * L + rows, c, mask=rows < L)
    if WANT_PSV:
        _put(PSV + n * L * EV, psv, rows, evs, L, EV, EV)
    if HAS_Z:
        _put(PZ + n * L * EV, pz, rows, evs, L, EV, EV)


@triton.jit
def _block_terms(q, k, v, g, lse, d, r, c, mask, U, W, TM, Z, rows, cols, es, evs, n,
                 L, S, E, EV, scale, sml, sms, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                 SECOND: tl.constexpr, HAS_U: tl.constexpr, HAS_W: tl.constexpr,
                 HAS_M: tl.constexpr, HAS_Z: tl.constexpr, offset):
    """On one block: P, :math:`\\bar S = P \\odot (T - D)`, and for the double backward
    :math:`\\hat S`, :math:`C = \\hat S \\odot \\bar S + P \\odot (G z^\\top - rT - c)` and
    :math:`B = P \\odot (\\hat S - r)`."""
    s = _scores(q, k, mask, rows, cols, L, S, scale, sml, sms, CAUSAL, MASK_KIND)
    p = tl.exp(s - lse[:, None])
    t = tl.dot(g, tl.trans(v), input_precision="ieee")
    ds = p * (t - d[:, None])
    sh = tl.zeros_like(p)
    cc = tl.zeros_like(p)
    if SECOND:
        inner = -c[:, None] - r[:, None] * t
        if HAS_Z:
            z = _tile(Z + n * S * EV, cols, evs, S, EV, EV, 1)
            inner += tl.dot(g, tl.trans(z), input_precision="ieee")
        cc = inner * p
        if HAS_U or HAS_W or HAS_M:
            sh = _tangent(q, k, U + n * L * E, W + n * S * E, TM + offset, rows, cols, es, L, S,
                          E, scale, sml, sms, HAS_U, HAS_W, HAS_M)
            cc += sh * ds
    return p, ds, sh, cc


@triton.jit
def _query_side_kernel(Q, K, V, MASK, LSE, G, D, R, C, U, W, TM, Z,
                       DQ, FQ, FG, GM, FM, L, S, E, EV, H, scale, smb, smh, sml, sms,
                       CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, FIRST: tl.constexpr,
                       SECOND: tl.constexpr, HAS_U: tl.constexpr, HAS_W: tl.constexpr,
                       HAS_M: tl.constexpr, HAS_Z: tl.constexpr, MASK_GRAD: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, BEV: tl.constexpr):
    """Per query block: S-bar K (FIRST); C K + S-bar w and B V (SECOND); the tiles of S-bar
    and C (MASK_GRAD)."""
    n = tl.program_id(1).to(tl.int64)  # offsets of N x L x S elements pass 2**31
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    es, evs = tl.arange(0, BE), tl.arange(0, BEV)
    offset = (n // H) * smb + (n % H) * smh
    q = _tile(Q + n * L * E, rows, es, L, E, E, 1)
    g = _tile(G + n * L * EV, rows, evs, L, EV, EV, 1)
    lse = tl.load(LSE + n * L + rows, mask=rows < L, other=float("inf"))
    d = tl.load(D + n * L + rows, mask=rows < L, other=0.0)
    r = tl.zeros([BM], dtype=q.dtype)
    c = tl.zeros([BM], dtype=q.dtype)
    if SECOND:
        r = tl.load(R + n * L + rows, mask=rows < L, other=0.0)
        c = tl.load(C + n * L + rows, mask=rows < L, other=0.0)
    dq = tl.zeros([BM, BE], dtype=q.dtype)
    fq = tl.zeros([BM, BE], dtype=q.dtype)
    fg = tl.zeros([BM, BEV], dtype=q.dtype)
    end = S
    if CAUSAL:
        end = tl.minimum(S, (tl.program_id(0) + 1) * BM)
    for start in range(0, end, BN):
        cols = start + tl.arange(0, BN)
        k = _tile(K + n * S * E, cols, es, S, E, E, 1)
        v = _tile(V + n * S * EV, cols, evs, S, EV, EV, 1)
        p, ds, sh, cc = _block_terms(q, k, v, g, lse, d, r, c, MASK + offset, U, W, TM, Z,
                                     rows, cols, es, evs, n, L, S, E, EV, scale, sml, sms,
                                     CAUSAL, MASK_KIND, SECOND, HAS_U, HAS_W, HAS_M, HAS_Z,
                                     offset)
        if FIRST:
            dq += tl.dot(ds, k, input_precision="ieee")
        if SECOND:
            fq += tl.dot(cc, k, input_precision="ieee")
            if HAS_W:
                w = _tile(W + n * S * E, cols, es, S, E, E, 1)
                fq += tl.dot(ds, w, input_precision="ieee")
            if HAS_U or HAS_W or HAS_M:
                fg += tl.dot(p * (sh - r[:, None]), v, input_precision="ieee")
        if MASK_GRAD:
            if FIRST:
                _put(GM + n * L * S, ds, rows, cols, L, S, S)
            if SECOND:
                _put(FM + n * L * S, cc, rows, cols, L, S, S)
    if FIRST:
        _put(DQ + n * L * E, dq * scale, rows, es, L, E, E)
    if SECOND:
        _put(FQ + n * L * E, fq * scale, rows, es, L, E, E)
        _put(FG + n * L * EV, fg, rows, evs, L, EV, EV)


@triton.jit
def _key_side_kernel(Q, K, V, MASK, LSE, G, D, R, C, U, W, TM, Z,
                     DK, DV, FK, FV, L, S, E, EV, H, scale, smb, smh, sml, sms,
                     CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, FIRST: tl.constexpr,
                     SECOND: tl.constexpr, HAS_U: tl.constexpr, HAS_W: tl.constexpr,
                     HAS_M: tl.constexpr, HAS_Z: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, BEV: tl.constexpr):
    """Per key block: S-bar^T Q and P^T G (FIRST); C^T Q + S-bar^T u and B^T G (SECOND)."""
    n = tl.program_id(1).to(tl.int64)  # offsets of N x L x S elements pass 2**31
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    es, evs = tl.arange(0, BE), tl.arange(0, BEV)
    offset = (n // H) * smb + (n % H) * smh
    k = _tile(K + n * S * E, cols, es, S, E, E, 1)
    v = _tile(V + n * S * EV, cols, evs, S, EV, EV, 1)
    dk = tl.zeros([BN, BE], dtype=k.dtype)
    dv = tl.zeros([BN, BEV], dtype=k.dtype)
    fk = tl.zeros([BN, BE], dtype=k.dtype)
    fv = tl.zeros([BN, BEV], dtype=k.dtype)
    begin = 0
    if CAUSAL:
        begin = (tl.program_id(0) * BN // BM) * BM
    for start in range(begin, L, BM):
        rows = start + tl.arange(0, BM)
        q = _tile(Q + n * L * E, rows, es, L, E, E, 1)
        g = _tile(G + n * L * EV, rows, evs, L, EV, EV, 1)
        lse = tl.load(LSE + n * L + rows, mask=rows < L, other=float("inf"))
        d = tl.load(D + n * L + rows, mask=rows < L, other=0.0)
        r = tl.zeros([BM], dtype=k.dtype)
        c = tl.zeros([BM], dtype=k.dtype)
        if SECOND:
            r = tl.load(R + n * L + rows, mask=rows < L, other=0.0)
            c = tl.load(C + n * L + rows, mask=rows < L, other=0.0)
        p, ds, sh, cc = _block_terms(q, k, v, g, lse, d, r, c, MASK + offset, U, W, TM, Z,
                                     rows, cols, es, evs, n, L, S, E, EV, scale, sml, sms,
                                     CAUSAL, MASK_KIND, SECOND, HAS_U, HAS_W, HAS_M, HAS_Z,
                                     offset)
        if FIRST:
            dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
            dv += tl.dot(tl.trans(p), g, input_precision="ieee")
        if SECOND:
            fk += tl.dot(tl.trans(cc), q, input_precision="ieee")
            if HAS_U:
                u = _tile(U + n * L * E, rows, es, L, E, E, 1)
                fk += tl.dot(tl.trans(ds), u, input_precision="ieee")
            if HAS_U or HAS_W or HAS_M:
                fv += tl.dot(tl.trans(p * (sh - r[:, None])), g, input_precision="ieee")
    if FIRST:
        _put(DK + n * S * E, dk * scale, cols, es, S, E, E)
        _put(DV + n * S * EV, dv, cols, evs, S, EV, EV)
    if SECOND:
        _put(FK + n * S * E, fk * scale, cols, es, S, E, E)
        _put(FV + n * S * EV, fv, cols, evs, S, EV, EV)


def block_size(width: int, itemsize: int, device: torch.device) -> int:
    """Queries (and keys) per block for head dimensions padded to ``width`` and elements of
    ``itemsize`` bytes: 64 x 64 float32 blocks of 64-wide heads on a GPU with 200 KB of shared
    memory per block or more (the double backward's key-side kernel then takes 160 KB at one
    pipeline stage, compiled for sm_90), half as many elements below; 16 to 64."""
    budget = 64 * 64 * 4
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        if getattr(props, "shared_memory_per_block_optin", 0) < 200 * 1024:
            budget //= 2
    fit = budget // (width * itemsize)
    return max(16, min(64, 1 << (fit.bit_length() - 1) if fit else 16))


class _Launch:
    """One attention call as the kernels take it: [N, L, E] contiguous tensors (N the leading
    dimensions flattened), the mask as [B, H, L, S] strides (0 where broadcast), block sizes."""

    def __init__(self, a: Attention) -> None:
        self.a = a
        q, k, v = a.q, a.k, a.v
        self.lead = q.shape[:-2]
        (self.L, self.E), (self.S, self.EV) = q.shape[-2:], v.shape[-2:]
        self.n = math.prod(self.lead)
        self.q, self.k, self.v = (self.flat(t) for t in (q, k, v))
        self.heads = self.lead[-1] if self.lead else 1
        self.mask_kind = (_NONE if a.mask is None else
                          _BOOL if a.mask.dtype == torch.bool else _ADDITIVE)
        self.mask, self.mask_strides = self.layout(a.mask)
        be, bev = (max(16, triton.next_power_of_2(x)) for x in (self.E, self.EV))
        block = block_size(max(be, bev), q.element_size(), q.device) if BLOCK is None else BLOCK
        # one pipeline stage: the blocks of the double backward's kernels fill shared memory
        self.meta = {"CAUSAL": a.causal, "MASK_KIND": self.mask_kind, "BM": block, "BN": block,
                     "BE": be, "BEV": bev, "num_stages": 1, "num_warps": 4}
        self.rows_grid = (triton.cdiv(self.L, block), self.n)
        self.cols_grid = (triton.cdiv(self.S, block), self.n)

    def flat(self, t: Tensor | None) -> Tensor | None:
        """``t`` [..., X, Y] as a contiguous [N, X, Y] (None stays None)."""
        return None if t is None else t.reshape(self.n, *t.shape[-2:]).contiguous()

    def rows(self, t: Tensor) -> Tensor:
        """A per-query tensor [..., L] or [..., L, 1] as a contiguous [N, L]."""
        return t.reshape(self.n, self.L).contiguous()

    def layout(self, mask: Tensor | None) -> tuple[Tensor, tuple[int, int, int, int]]:
        """A mask-shaped tensor as a [B, H, L, S] view (broadcast dimensions of stride 0) and its
        strides; the queries where there is none."""
        if mask is None:
            return self.q, (0, 0, 0, 0)
        full = mask.contiguous().expand(*self.lead, self.L, self.S)  # a tangent's strides too
        full = full.reshape(self.n // self.heads, self.heads, self.L, self.S)
        return full, full.stride()

    def unflat(self, t: Tensor | None) -> Tensor | None:
        return None if t is None else t.reshape(*self.lead, *t.shape[-2:])

    def mask_gradient(self, tiles: Tensor) -> Tensor:
        """The gradient of the mask from its [N, L, S] tiles: summed over broadcast
        dimensions."""
        return tiles.reshape(*self.lead, self.L, self.S).sum_to_size(self.a.mask.shape)

    def common(self) -> tuple:
        return (self.q, self.k, self.v, self.mask)

    def sizes(self) -> tuple:
        return (self.L, self.S, self.E, self.EV, self.heads, self.a.scale, *self.mask_strides)


def forward(a: Attention) -> tuple[Tensor, Tensor]:
    """:math:`O` [..., L, Ev] (in the queries' dtype) and :math:`\\ell` [..., L] (float32 at
    least; ``+inf`` on a query with no allowed key, whose output is 0)."""
    out, lse = _forward(a)
    return out.to(a.q.dtype), lse


@_in_float32(keep=True)
def _forward(a: Attention) -> tuple[Tensor, Tensor]:
    run = _Launch(a)
    out = torch.empty(run.n, run.L, run.EV, dtype=run.q.dtype, device=run.q.device)
    lse = torch.empty(run.n, run.L, dtype=run.q.dtype, device=run.q.device)
    _forward_kernel[run.rows_grid](*run.common(), out, lse, *run.sizes(), **run.meta)
    return run.unflat(out), lse.reshape(*run.lead, run.L)


def _row_sums(run: _Launch, lse: Tensor, tangents: tuple[Tensor | None, ...], *,
              z: Tensor | None = None, g: Tensor | None = None, d: Tensor | None = None,
              psv: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """``(r, rowsum(S^ . S-bar), (P . S^) V, P z)`` for the score tangent of ``tangents``
    :math:`(u, w, m)` (None: zero): r [N, L], the rest None where not asked."""
    u, w, m = tangents
    new = run.q.new_zeros
    r = new(run.n, run.L)
    c = new(run.n, run.L) if g is not None else None
    out_psv = new(run.n, run.L, run.EV) if psv else None
    pz = new(run.n, run.L, run.EV) if z is not None else None
    mm, _ = run.layout(m) if m is not None else (run.q, None)
    _row_sums_kernel[run.rows_grid](
        *run.common(), lse, _or(g, run.q), _or(d, run.q), _or(u, run.q), _or(w, run.q), mm,
        _or(z, run.q), r, _or(c, r), _or(out_psv, r), _or(pz, r), *run.sizes(),
        HAS_U=u is not None, HAS_W=w is not None, HAS_M=m is not None, HAS_Z=z is not None,
        WANT_C=g is not None, WANT_PSV=psv, **run.meta)
    return r, c, out_psv, pz


def _or(t: Tensor | None, default: Tensor) -> Tensor:
    """``t``, or a tensor the kernel does not read where it is None."""
    return default if t is None else t


def _gradients(run: _Launch, lse: Tensor, g: Tensor, d: Tensor, *, first: bool,
               second: tuple | None, mask_grad: bool) -> tuple:
    """The query-side and key-side kernels: ``(dq, dk, dv, gm)`` where ``first``;
    ``(fq, fk, fv, fm, fg)`` for ``second`` = (u, w, z, m, r, c) (None: none asked)."""
    u, w, z, m, r, c = second or (None,) * 6
    new, empty = run.q.new_zeros, run.q.new_empty
    dq, fq, fg = (empty(run.n, run.L, run.E) if first else None,
                  empty(run.n, run.L, run.E) if second else None,
                  empty(run.n, run.L, run.EV) if second else None)
    dk, dv = (empty(run.n, run.S, run.E), empty(run.n, run.S, run.EV)) if first else (None, None)
    fk, fv = (empty(run.n, run.S, run.E), empty(run.n, run.S, run.EV)) if second else (None, None)
    gm = new(run.n, run.L, run.S) if mask_grad and first else None
    fm = new(run.n, run.L, run.S) if mask_grad and second else None
    mm, _ = run.layout(m) if m is not None else (run.q, None)
    flags = {"FIRST": first, "SECOND": second is not None, "HAS_U": u is not None,
             "HAS_W": w is not None, "HAS_M": m is not None, "HAS_Z": z is not None}
    inputs = (*run.common(), lse, g, d, _or(r, d), _or(c, d), _or(u, run.q), _or(w, run.q), mm,
              _or(z, run.q))
    _query_side_kernel[run.rows_grid](
        *inputs, _or(dq, run.q), _or(fq, run.q), _or(fg, run.q), _or(gm, run.q),
        _or(fm, run.q), *run.sizes(), MASK_GRAD=mask_grad, **flags, **run.meta)
    _key_side_kernel[run.cols_grid](
        *inputs, _or(dk, run.q), _or(dv, run.q), _or(fk, run.q), _or(fv, run.q),
        *run.sizes(), **flags, **run.meta)
    mask_gradient = run.mask_gradient
    return ((run.unflat(dq), run.unflat(dk), run.unflat(dv),
             None if gm is None else mask_gradient(gm)) if first else None,
            (run.unflat(fq), run.unflat(fk), run.unflat(fv),
             None if fm is None else mask_gradient(fm), run.unflat(fg)) if second else None)


@_in_float32()
def vjp(a: Attention, lse: Tensor, out: Tensor, g: Tensor, mask_grad: bool
        ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:math:`(\\bar Q, \\bar K, \\bar V, \\bar M)` for the output cotangent ``g``, as
    :func:`gradreg.attention.blockwise.vjp`."""
    run = _Launch(a)
    d = run.rows((g * out).sum(-1))
    first, _ = _gradients(run, run.rows(lse), run.flat(g), d, first=True, second=None,
                          mask_grad=mask_grad)
    return first


@_in_float32()
def jvp(a: Attention, lse: Tensor, out: Tensor, dq: Tensor | None, dk: Tensor | None,
        dv: Tensor | None, dm: Tensor | None) -> Tensor:
    """:math:`\\dot O` for tangents (None: zero) of :math:`(Q, K, V, M)`, as
    :func:`gradreg.attention.blockwise.jvp`."""
    run = _Launch(a)
    rho, _, psv, pz = _row_sums(run, run.rows(lse), (run.flat(dq), run.flat(dk), dm),
                                z=run.flat(dv), psv=True)
    acc = psv if pz is None else psv + pz
    return run.unflat(acc) - rho.reshape(*run.lead, run.L, 1) * out


@_in_float32()
def second_order(a: Attention, lse: Tensor, out: Tensor, g: Tensor,
                 cotangents: tuple[Tensor | None, ...], mask_grad: bool, with_vjp: bool
                 ) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor | None], Tensor,
                            tuple[Tensor, Tensor, Tensor, Tensor | None] | None]:
    """The double backward (and, where ``with_vjp``, the backward) of
    :func:`gradreg.attention.blockwise.second_order`."""
    run = _Launch(a)
    u, w, z, m = (run.flat(cotangents[0]), run.flat(cotangents[1]), run.flat(cotangents[2]),
                  cotangents[3])
    lse_rows, gf = run.rows(lse), run.flat(g)
    d = run.rows((g * out).sum(-1))
    r, c, _, pz = _row_sums(run, lse_rows, (u, w, m), z=z, g=gf, d=d)
    c = c - r * d
    if pz is not None:
        c = c + (gf * pz).sum(-1)
    first, (fq, fk, fv, fm, fg) = _gradients(run, lse_rows, gf, d, first=with_vjp,
                                             second=(u, w, z, m, r, c), mask_grad=mask_grad)
    if pz is not None:
        fg = fg + run.unflat(pz)
    return (fq, fk, fv, fm), fg, first if with_vjp else None
