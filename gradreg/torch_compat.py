"""Every name of torch's that is not public API, in one place.

torch exports no public name for these; each is pinned by ``tests/test_torch_compat.py``, which
fails with the name, the torch version and this module when a torch release moves it. Where a
public API exists gradreg uses it instead (``torch.compiler.reset``, ``OpOverload.overloadpacket``,
``track_running_stats`` for the normalization layers that update running statistics).
"""

from __future__ import annotations

from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BatchNormBase", "TorchDispatchMode", "batchnorm_node_in_training", "dynamo_supported"]

#: The base class of ``nn.BatchNorm1d/2d/3d``: their parameters, buffers, state-dict keys and
#: running-statistics rule, which gradreg's BatchNorm keeps while replacing the forward.
BatchNormBase = _BatchNorm

#: A mode that sees every aten op dispatched while it is active (TF32 emulation, FLOP counts).
#: ``torch.overrides.TorchFunctionMode`` is public but sees ``torch.*`` calls, not the aten ops
#: of the backward passes.
TorchDispatchMode = TorchDispatchMode

#: The attribute of a BatchNorm forward node in the autograd graph that holds its ``training``
#: argument (batch statistics when true).
SAVED_TRAINING = "_saved_training"


def batchnorm_node_in_training(node: object) -> bool:
    """Whether a BatchNorm node of the autograd graph normalized by batch statistics. A node
    that does not say (gradreg's BatchNorm, whose forward is its own ``autograd.Function``, is
    there only in training mode) counts as training."""
    return bool(getattr(node, SAVED_TRAINING, True))


def dynamo_supported() -> bool:
    """Whether ``torch.compile`` can trace on this Python and platform (``method="compiled"``)."""
    from torch._dynamo import is_dynamo_supported  # importing dynamo takes a second: on demand

    return is_dynamo_supported()
