"""The arithmetic a result was computed in, and the finite-difference step it calls for.

The unit roundoff :math:`u` of float64, float32, TF32 (what GPUs use for float32 convolutions and,
at matmul precision ``"high"``, matmuls) or an autocast dtype, read off the outputs and their
graph; :func:`default_step` turns it into the step of
:func:`~gradreg.penalties.methods.finite_difference.finite_difference`, and
:func:`check_difference_rounding` refuses a difference quotient of the model's outputs (the
perturbation estimate, the Hessian penalty's second difference) whose rounding error could pass for
the quantity it estimates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradreg.autograd import GradientError
from gradreg.graph import graph_node_names

__all__ = ["MAX_DIFFERENCE_ROUNDING", "PARAMETER_STEPS", "STEPS", "TF32_ROUNDOFF",
           "check_difference_rounding", "cuda_float32_roundoff", "default_step", "unit_roundoff"]

#: Unit roundoff of TF32 (10 explicit mantissa bits), which cuDNN convolutions use for float32 on
#: Ampere and newer GPUs by default (``torch.backends.cudnn.allow_tf32``), and cuBLAS matmuls
#: where ``torch.get_float32_matmul_precision()`` is ``"high"``.
TF32_ROUNDOFF = 2.0**-11

#: The finite-difference step for the unit roundoff of the arithmetic: float64, float32, TF32.
#: Chosen by sweeps of the parameter gradient's error against float64 double backward on tanh,
#: softplus, ELU and SiLU MLPs, CNNs and DCGAN-style critics (TF32 emulated on the CPU by rounding
#: the operands of every convolution and matmul, forward and backward, to 10 mantissa bits).
STEPS = {2.0**-53: 1e-6, 2.0**-24: 1e-2, TF32_ROUNDOFF: 0.5}
#: The step of the parameter shift (``points="parameters"``: ``param_grad_norm``, ``sam``), by
#: unit roundoff. In float32 1e-2 left 4.9% of the penalty's gradient on the transformer
#: classifier of ``scripts/benchmark.py --param-gradient`` (0.23% on the digits MLP); 1e-3 leaves
#: 0.47% and 0.07% (measured against float64 double backward; the sweep is in
#: ``docs/parameter_gradients.md``). TF32's step scales the float32 one by the square root of the
#: roundoffs' ratio (truncation O(r) against rounding O(u/r)), not measured.
PARAMETER_STEPS = {2.0**-53: 1e-6, 2.0**-24: 1e-3, TF32_ROUNDOFF: 0.1}

#: The largest rounding error of a difference quotient of outputs, in units of the outputs' size,
#: that :func:`check_difference_rounding` accepts.
MAX_DIFFERENCE_ROUNDING = 1e-2

_CONVOLUTIONS = ("Convolution", "CudnnConvolution")
_MATMULS = ("Mm", "Addmm", "Bmm", "Baddbmm", "Addbmm", "Addmv", "Mv", "Dot", "Linear")


def unit_roundoff(outputs: Tensor) -> float:
    """The unit roundoff of the arithmetic that computed ``outputs``, as it actually ran.

    That of the dtype, except under autocast, that of the autocast dtype (the model ran in it even
    where the outputs, a loss, are float32), and for float32 on CUDA, where TF32 may stand in
    (:func:`cuda_float32_roundoff` with torch's current flags; only there is the graph walked).
    """
    device = outputs.device.type
    if torch.is_autocast_enabled(device):
        return torch.finfo(torch.get_autocast_dtype(device)).eps / 2
    if device != "cuda" or outputs.dtype != torch.float32:
        return torch.finfo(outputs.dtype).eps / 2
    return cuda_float32_roundoff(graph_node_names([outputs]),
                                 conv_tf32=torch.backends.cudnn.allow_tf32,
                                 matmul_precision=torch.get_float32_matmul_precision())


def cuda_float32_roundoff(names: set[str], *, conv_tf32: bool, matmul_precision: str) -> float:
    """The unit roundoff of float32 CUDA work whose backward graph holds the nodes ``names``:
    TF32's (2**-11) where it holds convolutions and ``conv_tf32``
    (``torch.backends.cudnn.allow_tf32``, on by default) or matmuls and ``matmul_precision``
    (``torch.get_float32_matmul_precision()``) is ``"high"``; bf16's (2**-8) for matmuls at
    ``"medium"``; else float32's (2**-24)."""
    roundoff = 2.0**-24
    if matmul_precision != "highest" and any(name.startswith(_MATMULS) for name in names):
        roundoff = TF32_ROUNDOFF if matmul_precision == "high" else 2.0**-8
    if conv_tf32 and any(name.startswith(_CONVOLUTIONS) for name in names):
        roundoff = max(roundoff, TF32_ROUNDOFF)
    return roundoff


def default_step(roundoff: float, *, parameters: bool = False) -> float:
    r"""The finite-difference step (the input-space length of each sample's shift) for
    arithmetic of unit roundoff ``roundoff`` (:func:`unit_roundoff`), from :data:`STEPS`.

    It balances truncation :math:`O(\text{eps})` against rounding :math:`O(u/\text{eps})`:
    1e-6 in float64, 1e-2 in float32, 0.5 in TF32, whose rounding noise is 8192 times float32's;
    with ``parameters``, the length of the parameter shift (:data:`PARAMETER_STEPS`).
    Coarser arithmetic (bf16, fp16, bf16 matmuls) is refused: it loses all digits (a parameter
    shift's difference of bf16 gradients is rounding noise; the message names ``step`` for a run
    that takes it anyway, as gradientregularization_trl's bf16 recipe does).
    """
    for unit, step in sorted((PARAMETER_STEPS if parameters else STEPS).items()):
        if roundoff <= unit:
            return step
    where = ("compute the loss and the penalty in float32 or float64 (LossAt.run and the penalty "
             "outside autocast), pass step to take the difference in this arithmetic anyway, "
             if parameters else
             "run the penalty in float32 or float64 (disable autocast around it), ")
    raise GradientError(
        f"finite differences in arithmetic of unit roundoff {roundoff:.1e} (bf16/fp16, autocast, "
        f"or float32 matmul precision 'medium') lose all digits to rounding: {where}or use "
        "method='double_backward'."
    )


def check_difference_rounding(outputs: Sequence[Tensor], *, step: float, order: int,
                              weight: float, what: str, step_name: str, exact: str) -> None:
    r"""Refuse a difference quotient of ``outputs`` that rounding could swamp.

    Each output carries a rounding error of about :math:`u\,|f|` (:math:`u` the
    :func:`unit_roundoff` of the arithmetic that computed it), so a quotient
    :math:`\sum_i c_i f(x + a_i h) / h^n` with :math:`\sum_i |c_i|` = ``weight`` carries up to
    :math:`\text{weight}\cdot u / h^n` of the outputs' size (``h`` = ``step``, ``n`` =
    ``order``). Above :data:`MAX_DIFFERENCE_ROUNDING` (float32 at the default steps: 1.2e-5 to
    2.4e-5; TF32 or bf16 there: 0.1 to 1.6) the estimate would measure rounding noise:
    raises :class:`~gradreg.autograd.GradientError` naming ``what`` was computed, the step
    that would suffice, and ``exact``, the method without differences.
    """
    roundoff = max(unit_roundoff(output) for output in outputs)
    rounding = weight * roundoff / step**order
    if rounding <= MAX_DIFFERENCE_ROUNDING:
        return
    smallest = (weight * roundoff / MAX_DIFFERENCE_ROUNDING) ** (1 / order)
    coarse = roundoff > 2.0**-24
    source = (" (bf16/fp16 autocast, TF32, or float32 matmul precision 'medium')" if coarse
              else "")
    fixes = ("run it in float32 or float64 (outside autocast, TF32 off), " if coarse
             else "run it in float64, ")
    raise GradientError(
        f"{what} at {step_name}={step} in arithmetic of unit roundoff {roundoff:.1e}{source} "
        f"carries a rounding error of up to {rounding:.2g} of the outputs' size (more than "
        f"{MAX_DIFFERENCE_ROUNDING:g}): it would measure rounding noise. Take a step "
        f"{step_name} >= {smallest:.2g} in this arithmetic, {fixes}or use {exact}."
    )
