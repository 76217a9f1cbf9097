r"""Which attention runs: :func:`differentiable_attention` routes every
``F.scaled_dot_product_attention`` call made while it is active (``nn.MultiheadAttention`` and the
``nn.TransformerEncoder`` layers in train and eval mode, timm's ViT with ``fused_attn``, Hugging
Face models with ``attn_implementation="sdpa"``) through :func:`scaled_dot_product_attention`, which
takes the backend's kernels (:data:`BACKENDS`: :mod:`gradreg.attention.blockwise`, or
:mod:`gradreg.attention.triton`, imported only when asked for) to the autograd functions of
:mod:`gradreg.attention.functions`. Wrap it around the forward whose graph a penalty differentiates,
and only that forward: a task loss without a penalty keeps the fused backward. A penalty called with
the model itself (``penalty(D, x)``) by an exact method enters it by itself.

``dropout_p > 0`` (attention dropout in training mode) runs the MATH backend for that call: the
dropout mask of a fused kernel cannot be recovered for the backward, and MATH's dropout is an
ordinary differentiable op, so the result equals a model with MATH attention everywhere (the same
random numbers), at MATH's memory (quadratic in the sequence). ``enable_gqa`` (torch >= 2.5) repeats
the key and value heads before the kernel. Nested (ragged) tensors are refused. Under a
``torch.func`` transform the forward is :func:`~gradreg.attention.functions.reference_attention`, in
ops.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from gradreg.attention import blockwise
from gradreg.attention.functions import FUSED, attention, reference_attention
from gradreg.autograd import GradientError
from gradreg.torch_compat import attention_in_functional, functorch_transform_active

__all__ = ["BACKENDS", "differentiable_attention", "explain_fused_attention",
           "scaled_dot_product_attention"]

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
    """:mod:`gradreg.attention.triton`; a clear error where Triton is not installed (or too old)."""
    try:
        from gradreg.attention import triton as kernels
    except ImportError as err:
        raise GradientError(
            f"backend='triton' needs Triton ({err}): pip install 'gradreg[triton]', or use "
            "backend='blockwise'.") from err
    return kernels


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
    differentiated again (:mod:`gradreg.attention.functions`); a drop-in replacement. ``backend``:
    one of :data:`BACKENDS`, that of the enclosing :func:`differentiable_attention` where None
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
            return FUSED(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
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
        return reference_attention(query, key, value, attn_mask, is_causal, scale)
    return attention(query, key, value, attn_mask, is_causal, scale, _kernels(backend, query))


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
        if func is FUSED:
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

    ``backend`` (:data:`BACKENDS`): ``"blockwise"``, the fused kernel's forward and the derivatives
    of :mod:`gradreg.attention.blockwise`; ``"triton"``, the forward and the derivatives as Triton
    kernels (:mod:`gradreg.attention.triton`; ``pip install 'gradreg[triton]'``), on CUDA tensors,
    checked in Triton's interpreter but not yet run on a GPU; ``"auto"`` (the default, None):
    ``"blockwise"``. Nested uses are one context (an inner one given a backend uses it until it is
    left). The backward may run after the context is left, with the backend of the forward."""
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
