"""Whether a function is smooth where a finite difference differences it: the ops of its autograd
graph whose derivative jumps (ReLU and its kin, max pooling, clamp, abs, max/min). Across such a
kink a difference quotient has an O(1) error that a smaller step does not remove."""

from __future__ import annotations

from torch import Tensor

from gradreg.graph import graph_node_names

__all__ = ["PIECEWISE_LINEAR", "piecewise_linear_ops"]

#: Backward-node name prefixes of the ops whose derivative jumps (activations, max pooling, clamp,
#: abs, max/min): a finite difference across a kink has an O(1) error.
PIECEWISE_LINEAR = (
    "Relu", "LeakyRelu", "RreluWithNoise", "PreluKernel", "Hardtanh", "Threshold", "Hardswish",
    "Hardsigmoid", "Hardshrink", "Softshrink", "MaxPool", "AdaptiveMaxPool", "Clamp", "Abs",
    "Maximum", "Minimum", "Max", "Min", "Amax", "Amin",
)


def piecewise_linear_ops(outputs: Tensor) -> list[str]:
    """The piecewise-linear ops (:data:`PIECEWISE_LINEAR`) in the autograd graph of ``outputs``,
    by name (``"Relu"``, ``"MaxPool2D"``...), sorted; empty for a smooth graph."""
    return sorted({name.split("Backward")[0] for name in graph_node_names([outputs])
                   if name.startswith(PIECEWISE_LINEAR)})
