"""Every name of torch's that is not public API, in one place.

torch exports no public name for these; each is pinned by ``tests/test_torch_compat.py``, which
fails with the name, the torch version and this module when a torch release moves it. Where a
public API exists gradreg uses it instead (``torch.compiler.reset``, ``OpOverload.overloadpacket``,
``track_running_stats`` for the normalization layers that update running statistics;
``fully_shard`` and ``FSDPModule`` for FSDP2 from torch 2.6).

FSDP2 (``fully_shard``) has a public module API, but none for what an exact gradient penalty
needs (:mod:`gradreg.sharding`): its parameter groups, their reshard and reduce settings and
their post-backward. The functions below are the only places gradreg reads or drives them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "ANOMALY_PARENT_KEY",
    "COMPILED_NODE",
    "FSDP_GROUP_HOLD",
    "FSDP_POST_BACKWARD_NODE",
    "FSDP_STATE_HOLD",
    "BatchNormBase",
    "FSDPSettings",
    "NormBase",
    "TorchDispatchMode",
    "attention_in_functional",
    "batchnorm_node_in_training",
    "created_by_a_backward",
    "dtensor_type",
    "dynamo_supported",
    "fsdp_group_mesh_ndim",
    "fsdp_group_name",
    "fsdp_group_of_node",
    "fsdp_group_offloads_to_cpu",
    "fsdp_group_params",
    "fsdp_group_reduces_gradients",
    "fsdp_module_type",
    "fsdp_param_groups",
    "fsdp_param_name",
    "fsdp_param_received_gradient",
    "fsdp_sharded_param",
    "fsdp_step_settings",
    "fsdp_unsharded_param",
    "functorch_transform_active",
    "once_differentiable_function",
    "run_fsdp_post_backward",
]

#: The base class of ``nn.BatchNorm1d/2d/3d``: their parameters, buffers, state-dict keys and
#: running-statistics rule, which gradreg's BatchNorm keeps while replacing the forward.
BatchNormBase = _BatchNorm

#: The base class of the normalization layers that may keep running statistics (BatchNorm,
#: SyncBatchNorm, InstanceNorm, gradreg's BatchNorm): their buffers are what a repeated forward
#: sets aside (:mod:`gradreg.penalties.state.buffers`).
NormBase = _NormBase

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


#: The metadata key under which autograd's anomaly mode records, on every node created while a
#: backward runs, the node being differentiated (torch/csrc/autograd/python_anomaly_mode.h).
ANOMALY_PARENT_KEY = "parent_"


def created_by_a_backward(node: Any) -> bool:
    """Whether the autograd node ``node`` was created while a backward ran (a node of the graph
    of a gradient built with ``create_graph=True``). Only known for nodes created under
    ``torch.autograd.set_detect_anomaly(True)``; False otherwise."""
    return ANOMALY_PARENT_KEY in node.metadata


#: The code of every backward that ``@once_differentiable`` wraps (one wrapper function, whose
#: name and docstring ``functools.wraps`` replaces by the wrapped backward's).
_ONCE_DIFFERENTIABLE_CODE = once_differentiable(lambda ctx: None).__code__


def once_differentiable_function(node: Any) -> type | None:
    """The ``torch.autograd.Function`` whose forward created the autograd node ``node``, where
    its ``backward`` is decorated with ``@once_differentiable``; else None.

    Such a backward runs under ``no_grad``: where its incoming gradient does not require grad
    (the op at a model's output, whose incoming gradient is the constant ``grad_outputs``), the
    gradient it returns carries no graph and its dependence on the op's saved inputs is dropped
    without an error, so a double backward through it is silently wrong.
    """
    function = getattr(node, "_forward_cls", None)  # custom Functions' nodes (BackwardCFunction)
    backward = getattr(function, "backward", None)
    return function if getattr(backward, "__code__", None) is _ONCE_DIFFERENTIABLE_CODE else None


#: ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, the transformer layers) calls
#: the module attribute ``torch.nn.functional.scaled_dot_product_attention`` from its body, which
#: a ``TorchFunctionMode`` does not see (the function dispatches to the mode as a whole).
_ATTENTION_NAME = "scaled_dot_product_attention"
_attention_lock = threading.Lock()
_attention_state: dict[str, Any] = {"users": 0, "original": None}


@contextmanager
def attention_in_functional(replacement: Callable[..., Any]) -> Iterator[None]:
    """``torch.nn.functional.scaled_dot_product_attention`` is ``replacement`` while this is
    active (the attention that ``F.multi_head_attention_forward`` calls); the fused function is
    restored when the last user leaves. ``replacement`` must compute the same output (it is
    seen by every thread meanwhile)."""
    with _attention_lock:
        if _attention_state["users"] == 0:
            _attention_state["original"] = getattr(F, _ATTENTION_NAME)
            setattr(F, _ATTENTION_NAME, replacement)
        _attention_state["users"] += 1
    try:
        yield
    finally:
        with _attention_lock:
            _attention_state["users"] -= 1
            if _attention_state["users"] == 0:
                setattr(F, _ATTENTION_NAME, _attention_state["original"])


#: The autograd node of a compiled region (aot_autograd's ``CompiledFunction``),
#: which has no double backward.
COMPILED_NODE = "CompiledFunctionBackward"


def functorch_transform_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vjp``, ``jvp``, ``vmap``...) is running
    (the current level of functorch's interpreter stack)."""
    return torch._C._functorch.maybe_current_level() is not None


def dynamo_supported() -> bool:
    """Whether ``torch.compile`` can trace on this Python and platform (``method="compiled"``)."""
    from torch._dynamo import is_dynamo_supported  # importing dynamo takes a second: on demand

    return is_dynamo_supported()


# FSDP2: an FSDP module's state holds parameter groups (the parameters it gathers and reduces
# together); each group holds FSDP parameters, each the pair of a sharded parameter (the
# module's, a DTensor) and, once gathered, an unsharded one (what forward and backward use).

#: FSDP2's autograd node on a sharded module's inputs, which runs its group's post-backward.
FSDP_POST_BACKWARD_NODE = "RegisterPostBackwardFunctionBackward"

#: The settings of FSDP2's parameter groups that an exact penalty step holds, and the values it
#: holds: no reshard after forward (``post_forward_mesh_info`` None) or backward, no gradient
#: reduction. FSDP2's public setters (``set_reshard_after_backward``,
#: ``set_requires_gradient_sync``) have no getters to restore the module's own values from.
FSDP_GROUP_HOLD = {"post_forward_mesh_info": None, "reshard_after_backward": False,
                   "reduce_grads": False, "all_reduce_grads": False}
#: The same on FSDP2's module states: no automatic reshard after forward.
FSDP_STATE_HOLD = {"_auto_reshard_after_forward": False}


def fsdp_module_type() -> type | None:
    """FSDP2's module class (``fully_shard`` makes a module an instance of it): public from
    torch 2.6, private in 2.4 and 2.5; None where this torch has none."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


@functools.cache
def dtensor_type() -> type | None:
    """The class of FSDP2's sharded parameters (``DTensor``): public from torch 2.5, private in
    2.4; None where this torch has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def _fsdp_state(module: nn.Module) -> Any:
    return module._get_fsdp_state()


def fsdp_param_groups(module: nn.Module) -> list[Any]:
    """The parameter groups of the FSDP2 module ``module`` (a list in newer torch, at most one
    group in older)."""
    state = _fsdp_state(module)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def fsdp_group_mesh_ndim(group: Any) -> int:
    """The number of dimensions of the device mesh ``group`` is sharded on (2: hybrid)."""
    return group.mesh_info.mesh.ndim


def fsdp_group_params(group: Any) -> list[Any]:
    """The FSDP parameters of ``group``."""
    return list(group.fsdp_params)


def fsdp_group_offloads_to_cpu(group: Any) -> bool:
    """Whether ``group`` keeps parameters on the CPU between steps (``CPUOffloadPolicy``)."""
    return any(p.offload_to_cpu for p in group.fsdp_params)


def fsdp_group_reduces_gradients(group: Any) -> bool:
    """Whether ``group``'s post-backward reduce-scatters its gradients into the sharded
    ``.grad`` (false while ``set_requires_gradient_sync(False)``)."""
    return group.reduce_grads


def fsdp_group_name(group: Any) -> str:
    """The qualified name of the module of ``group``, from the root; "the root" for the root."""
    return str(getattr(group, "_module_fqn", None) or "the root")


def fsdp_group_of_node(node: object) -> Any | None:
    """The parameter group whose post-backward the autograd node ``node`` runs, or None where
    ``node`` is no such node of FSDP2."""
    if type(node).__name__ != FSDP_POST_BACKWARD_NODE:
        return None
    return getattr(node, "param_group", None)


def fsdp_sharded_param(fsdp_param: Any) -> nn.Parameter:
    """The module's (sharded) parameter of an FSDP parameter: the optimizer's, where the
    reduced gradient lands in ``.grad``."""
    return fsdp_param.sharded_param


def fsdp_unsharded_param(fsdp_param: Any) -> nn.Parameter | None:
    """The unsharded parameter of an FSDP parameter (the one the module computes with, whose
    ``.grad`` the post-backward reduces), or None where it is not gathered now."""
    if getattr(fsdp_param.sharded_state, "name", None) != "UNSHARDED":
        return None
    return getattr(fsdp_param, "_unsharded_param", None)


def fsdp_param_name(fsdp_param: Any) -> str:
    """The qualified name of an FSDP parameter, from the root module."""
    return str(fsdp_param._param_fqn)


def fsdp_param_received_gradient(fsdp_param: Any) -> bool:
    """Whether the unsharded parameter of an FSDP parameter holds a gradient not yet reduced
    (in ``.grad``, or in FSDP's accumulator where gradients are accumulated in another
    dtype)."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return (getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None
            or (unsharded is not None and unsharded.grad is not None))


@dataclass
class FSDPSettings:
    """One FSDP2 object's (parameter group's or state's) own values of the settings that a
    penalty step holds, those of ``held`` that this torch has: :meth:`hold` sets the held
    values, :meth:`restore` the object's own."""

    target: Any
    held: dict[str, Any]
    own: dict[str, Any]

    @classmethod
    def of(cls, target: Any, held: dict[str, Any]) -> FSDPSettings:
        return cls(target, held, {k: getattr(target, k) for k in held if hasattr(target, k)})

    def current(self) -> dict[str, Any]:
        """The values the object has now."""
        return {key: getattr(self.target, key) for key in self.own}

    def hold(self) -> None:
        for key in self.own:
            setattr(self.target, key, self.held[key])

    def restore(self) -> None:
        for key, value in self.own.items():
            setattr(self.target, key, value)


def fsdp_step_settings(module: nn.Module) -> list[FSDPSettings]:
    """The reshard and reduce settings of the FSDP2 module ``module``: those of its parameter
    groups (:data:`FSDP_GROUP_HOLD`) and of its state (:data:`FSDP_STATE_HOLD`)."""
    return ([FSDPSettings.of(group, FSDP_GROUP_HOLD) for group in fsdp_param_groups(module)]
            + [FSDPSettings.of(_fsdp_state(module), FSDP_STATE_HOLD)])


def run_fsdp_post_backward(root: nn.Module, groups: list[Any]) -> None:
    """FSDP's end of a backward for ``groups``, those of the FSDP2 module ``root``'s tree, as
    its own final callback runs it: each group's post-backward in backward order (the
    reduce-scatter of the unsharded gradients into the sharded ``.grad`` where the group
    reduces, then its reshard), the group left idle; then, where ``root``'s state says this is
    the last backward of the step, each group's finalization (gradient accumulation ends)."""
    for group in reversed(groups):
        group.post_backward()
        group._training_state = type(group._training_state).IDLE
    if _fsdp_state(root)._state_ctx.is_last_backward:
        for group in groups:
            group.finalize_backward()
