"""TF32 arithmetic on the CPU: the operands of every convolution and matmul (forward and backward)
rounded to TF32's 10 mantissa bits, products accumulated in float32, as tensor cores do for
float32 work on Ampere and newer GPUs with TF32 allowed (cuDNN's default for convolutions)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

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
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
        if func in ROUNDED_OPS:
            args = tuple(round_to_tf32(a) for a in args)
        return func(*args, **(kwargs or {}))
