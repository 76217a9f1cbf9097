"""gradreg: gradient penalties for PyTorch, exact and fast.

The core (this package's top-level modules and :mod:`gradreg.penalties`) depends on torch only.
"""

import warnings

with warnings.catch_warnings():
    # torch without numpy warns "Failed to initialize NumPy" while it imports itself (torch 2.13:
    # torch.export's FunctionalTensor converts to a CPU device in its class body); the core uses
    # no numpy, so where gradreg imports torch first the warning is left out
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

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
