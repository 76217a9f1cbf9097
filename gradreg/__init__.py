"""gradreg: gradient penalties for PyTorch, exact and fast.

The core (this package's top-level modules and :mod:`gradreg.penalties`) depends on torch only.
"""

from gradreg import penalties
from gradreg.attention import differentiable_attention
from gradreg.autograd import (
    GradientError,
    NonFiniteError,
    capture,
    check_double_backward,
    gradient,
    nth_derivative,
    regularized_backward,
)
from gradreg.batchnorm import convert_batchnorm
from gradreg.graph import AutogradGraph, autograd_graph

__all__ = [
    "AutogradGraph",
    "GradientError",
    "NonFiniteError",
    "autograd_graph",
    "capture",
    "check_double_backward",
    "convert_batchnorm",
    "differentiable_attention",
    "gradient",
    "nth_derivative",
    "penalties",
    "regularized_backward",
]
__version__ = "0.1.0"
