"""TF32 arithmetic emulated on any device, to see on a CPU what a GPU's defaults do to a result.

Tensor cores on Ampere and newer GPUs run float32 convolutions (cuDNN's default,
``torch.backends.cudnn.allow_tf32``) and, at float32 matmul precision ``"high"``, matmuls in TF32:
the operands are rounded to 10 mantissa bits (unit roundoff 2**-11 instead of float32's 2**-24)
and the products accumulated in float32. Inside ``with EmulatedTF32():`` every convolution and
matmul, forward and backward (double backward included), gets its float32 operands rounded the
same way (to nearest, ties away from zero). Used to choose and check the finite-difference step
for TF32 (:data:`gradreg.penalties.guards.precision.STEPS`, ``scripts/fd_error_sweep.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradreg.torch_compat import TorchDispatchMode

__all__ = ["ROUNDED_OPS", "EmulatedTF32", "round_to_tf32"]

aten = torch.ops.aten
ROUNDED_OPS = {aten.convolution.default, aten.convolution_backward.default, aten.mm.default,
               aten.addmm.default, aten.bmm.default}


def round_to_tf32(t: object) -> object:
    """float32 tensors rounded to nearest (ties away from zero) on 10 mantissa bits."""
    if not (isinstance(t, Tensor) and t.dtype == torch.float32):
        return t
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).view(t.shape)


class EmulatedTF32(TorchDispatchMode):
    """A dispatch mode rounding the float32 operands of :data:`ROUNDED_OPS` to TF32."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
        if func in ROUNDED_OPS:
            args = tuple(round_to_tf32(a) for a in args)
        return func(*args, **(kwargs or {}))
