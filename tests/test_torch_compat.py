"""torch's private names that gradreg uses, pinned: a torch release that moves one fails here,
naming it, the torch version and gradreg/torch_compat.py, the one module to change."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch import nn

from gradreg.batchnorm import BatchNorm1d
from gradreg.torch_compat import (
    SAVED_TRAINING,
    BatchNormBase,
    TorchDispatchMode,
    batchnorm_node_in_training,
    dynamo_supported,
)

PRIVATE_NAMES = [("torch.nn.modules.batchnorm", "_BatchNorm"),
                 ("torch.utils._python_dispatch", "TorchDispatchMode"),
                 ("torch._dynamo", "is_dynamo_supported")]


def moved(name: str) -> str:
    return f"torch {torch.__version__} has no {name}: update gradreg/torch_compat.py"


@pytest.mark.parametrize(("module", "name"), PRIVATE_NAMES)
def test_the_private_names_still_exist(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), moved(f"{module}.{name}")


def test_the_batchnorm_base_is_that_of_torchs_batchnorms() -> None:
    assert all(issubclass(cls, BatchNormBase)
               for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, BatchNorm1d)), moved(
        "torch.nn.modules.batchnorm._BatchNorm as the base of nn.BatchNorm1d/2d/3d")


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_nodes_say_their_mode(training: bool) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    node = nn.BatchNorm1d(3).train(training)(x).grad_fn
    assert hasattr(node, SAVED_TRAINING), moved(f"{type(node).__name__}.{SAVED_TRAINING}")
    assert batchnorm_node_in_training(node) is training


def test_a_dispatch_mode_sees_the_aten_ops_of_a_backward() -> None:
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
            seen.append(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(3, 4)
    with Record():
        (x @ w).sum().backward()
    assert torch.ops.aten.mm in seen, moved("a TorchDispatchMode that sees aten.mm")


def test_modules_still_load_their_state_through_load_from_state_dict() -> None:
    """GradientPenalty overrides it (to widen its running mean before a float64 one loads)."""
    names = list(inspect.signature(nn.Module._load_from_state_dict).parameters)
    assert names[:3] == ["self", "state_dict", "prefix"], moved(
        f"nn.Module._load_from_state_dict(self, state_dict, prefix, ...) (it takes {names})")


def test_dynamo_support_is_a_bool() -> None:
    assert dynamo_supported() in (True, False)
