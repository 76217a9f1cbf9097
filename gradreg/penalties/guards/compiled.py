"""Models run through ``torch.compile``: how to tell (:func:`runs_compiled`), and the refusal of
a double backward through them (:func:`check_not_compiled`)."""

from __future__ import annotations

from torch import Tensor

from gradreg.autograd import GradientError
from gradreg.graph import walk_backward_graph
from gradreg.torch_compat import COMPILED_NODE

__all__ = ["check_not_compiled", "runs_compiled"]

#: The penalties that need no double backward, which run on a torch.compile'd model.
WITHOUT_DOUBLE_BACKWARD = (
    "method='perturbation' (approx_r1, approx_r2, double backprop and the Jacobian with "
    "target 0), method='finite_difference' (input-gradient penalties with a numeric target; "
    "param_grad_norm given the loss as LossAt), or kind='hessian' by its finite difference")


def runs_compiled(outputs: Tensor) -> bool:
    """Whether the graph of ``outputs`` runs through a compiled region (``torch.compile``).
    Such a region's backward is compiled on its first use, and where that backward keeps no
    graph it donates its saved buffers: every later backward of the region that retains the
    graph (``retain_graph`` or ``create_graph``) raises. A method that needs two backwards of
    a compiled forward runs the forward once more instead, one backward each."""
    return outputs.grad_fn is not None and COMPILED_NODE in walk_backward_graph([outputs]).names()


def check_not_compiled(outputs: Tensor) -> None:
    """Raise where the graph of ``outputs`` runs through a compiled region: torch's
    compiled autograd has no double backward (aot_autograd raises, or ``chunks`` fails on its
    donated buffers), so an exact penalty cannot differentiate it twice."""
    if runs_compiled(outputs):
        raise GradientError(
            "an exact penalty (double backward) of a torch.compile'd model: compiled autograd "
            "has no double backward. Use a method that needs none on the compiled model, "
            f"{WITHOUT_DOUBLE_BACKWARD}; or compute the penalty's forward with the uncompiled "
            "module (model._orig_mod for torch.compile(model)), which double backward "
            "differentiates exactly.")
