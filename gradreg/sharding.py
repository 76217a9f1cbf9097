r"""Exact gradient penalties on FSDP2-sharded modules: :func:`penalty_step` around the step.

A penalty such as R1, :math:`P = \operatorname{mean}_i \lVert \nabla_{x_i} D_\theta(x_i)
\rVert^2`, is differentiated twice: the inner ``torch.autograd.grad(create_graph=True)`` builds
the graph of :math:`g_i = \nabla_{x_i} D_\theta(x_i)`, which saves the unsharded parameters
:math:`\theta`; the outer ``backward()`` differentiates it w.r.t. :math:`\theta`. FSDP2
(``fully_shard``) ties its parameter traffic to single backward passes, so on its own:

- by default the inner gradient's post-backward hooks reshard (free) the parameters that the
  outer backward then reads: ``setStorage: ... out of bounds for storage of size 0``;
- with the parameters kept unsharded (``reshard_after_forward=False``,
  ``set_reshard_after_backward(False)``), the post-backward reduce-scatter runs after the inner
  gradient, which gave the parameters nothing, and not after the outer backward: every
  parameter's ``.grad`` stays None, the whole update is lost without an error.

:func:`penalty_step` makes both exact with FSDP's own machinery. Inside it every FSDP2 module of
the tree keeps its parameters unsharded once gathered (no reshard after forward or backward)
and does not reduce gradients, so any number of forwards, inner gradients and backwards
accumulate the exact full gradient on the unsharded parameters, as in one process. On leaving
it, FSDP's post-backward runs once per parameter group: the same reduce-scatter (mean over the
ranks, in the policy's ``reduce_dtype``) into the sharded ``.grad`` as a plain backward would
do, then the reshard the module was configured with. So ``.grad`` equals that of the unsharded
module in one process up to the order of float summation, for any penalty (double backward,
finite differences, in chunks, with a task loss or alone): measured bitwise equal on 2 gloo
ranks for every preset but ``param_grad_norm`` (6e-8 in float32), also with bf16 parameters
and float32 reduction (``MixedPrecisionPolicy``) against the unsharded module in bf16::

    with gradreg.sharding.penalty_step(critic):
        loss = task_loss + r1(critic(real), real)
        loss.backward()
    optimizer.step()

Why this way, rather than a penalty gradient computed on gathered parameters through
``torch.func.functional_call`` and handed to the shards through a surrogate: it needs no change
to the user's code or to the penalty, serves every method and preset alike, and reduces with
FSDP's own reduce-scatter (its dtype policy, divide factors and gradient accumulation) instead
of a copy of it.

Memory: during the step each rank holds the full parameters of the sharded module and their
full gradients (the memory of parameters and gradients of the unsharded module, as DDP would);
the optimizer state and, between steps, the parameters stay sharded. The double-backward graph
saves the parameters of every layer until the outer backward, so the parameters cannot be freed
layer by layer during the step as FSDP does for a first-order loss. Measured on 2 CPU ranks
(``scripts/benchmark.py --sharded``): 3-5% more peak memory per rank than FSDP2's own
first-order step of the same critic.

FSDP2 internals: the step sets and restores the parameter groups' reshard and reduce settings and
calls their ``post_backward``/``finalize_backward``, which are not public API (older releases
keep one group per module, newer ones a list; both are read). Verified on torch 2.13 by the
parity tests; a torch whose FSDP2 no longer reduces here raises (the outcome check below).

Layouts not supported (refused on entering, before any computation): torch older than 2.6
(FSDP2's ``fully_shard`` is public from 2.6), hybrid sharding (a 2-D mesh) and CPU offload
(not verified). On those, or to keep the parameters sharded during the step, use a method with no
double backward, which FSDP2 supports as it is: ``method="finite_difference"``.

Outside the step, :func:`check_penalty_graph` refuses a penalty whose graph runs through an
FSDP2 module that no :func:`penalty_step` holds, before anything is differentiated (the
penalty mechanism can call it on the outputs it differentiates).

The step also checks its outcome: a parameter that got a gradient during the step and has no
sharded ``.grad`` after it raises :class:`~gradreg.autograd.GradientError` instead of a silent
loss of the update; so does a step in which no parameter that requires grad got a gradient
(the ``backward()`` must run inside the ``with`` block).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gradreg.autograd import GradientError
from gradreg.graph import walk_backward_graph

__all__ = ["FSDP_MIN_TORCH", "HeldStep", "check_penalty_graph", "is_sharded", "penalty_step",
           "sharded_modules"]

#: The first torch whose ``torch.distributed.fsdp`` exports ``fully_shard`` (FSDP2).
FSDP_MIN_TORCH = (2, 6)

_APPROXIMATE = "method='finite_difference' (no double backward, FSDP2 supports it as it is)"
#: FSDP2's autograd node on a sharded module's inputs, which runs its post-backward
_POST_BACKWARD_NODE = "RegisterPostBackwardFunctionBackward"
_HELD: weakref.WeakSet = weakref.WeakSet()  # the parameter groups inside a penalty_step


def _fsdp_module_type() -> type | None:
    """FSDP2's module class on this torch, or None where it has none (before 2.4)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def sharded_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules (``fully_shard`` applied) of ``module``'s tree, itself included."""
    fsdp_type = _fsdp_module_type()
    if fsdp_type is None:
        return []
    return [m for m in module.modules() if isinstance(m, fsdp_type)]


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or one of its submodules."""
    return bool(sharded_modules(module))


def _groups(state: Any) -> list[Any]:
    """The parameter groups of one FSDP2 state: a list in newer torch, one group in older."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _check_layout(modules: list[nn.Module]) -> None:
    if _torch_version() < FSDP_MIN_TORCH:
        raise GradientError(
            f"exact gradient penalties on fully_shard modules need torch >= "
            f"{'.'.join(map(str, FSDP_MIN_TORCH))} (torch {torch.__version__} has FSDP2 only "
            f"as a private API). Upgrade torch, or use {_APPROXIMATE}."
        )
    for module in modules:
        state = module._get_fsdp_state()
        for group in _groups(state):
            if group.mesh_info.mesh.ndim != 1:
                raise GradientError(
                    f"penalty_step supports fully_shard on a 1-D device mesh; "
                    f"{type(module).__name__} is sharded on a {group.mesh_info.mesh.ndim}-D mesh "
                    f"(hybrid sharding), where the exact step is not verified. Use a 1-D mesh, "
                    f"or {_APPROXIMATE}."
                )
            if any(p.offload_to_cpu for p in group.fsdp_params):
                raise GradientError(
                    f"penalty_step does not support CPUOffloadPolicy ({type(module).__name__} "
                    f"offloads its parameters), where the exact step is not verified. Remove "
                    f"the offload policy, or use {_APPROXIMATE}."
                )


def _received_gradient(fsdp_param: Any) -> bool:
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return (getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None
            or (unsharded is not None and unsharded.grad is not None))


#: The settings the step holds, on FSDP2's parameter groups and on its states: no reshard after
#: forward (``post_forward_mesh_info`` None) or backward, no gradient reduction (read where this
#: torch has them; ``set_reshard_after_forward`` and friends are not public in every release).
_GROUP_HOLD = {"post_forward_mesh_info": None, "reshard_after_backward": False,
               "reduce_grads": False, "all_reduce_grads": False}
_STATE_HOLD = {"_auto_reshard_after_forward": False}


@dataclass
class _Saved:
    """One FSDP2 object's own values of the settings the step holds (those it has)."""

    target: Any
    held: dict[str, Any]
    own: dict[str, Any]

    @classmethod
    def of(cls, target: Any, held: dict[str, Any]) -> _Saved:
        return cls(target, held, {k: getattr(target, k) for k in held if hasattr(target, k)})

    def hold(self) -> None:
        for key in self.own:
            setattr(self.target, key, self.held[key])

    def restore(self) -> None:
        for key, value in self.own.items():
            setattr(self.target, key, value)


class HeldStep:
    """The settings of :func:`penalty_step` held on a sharded module until :meth:`release`,
    for loops that call backward themselves (a trainer): call :meth:`reduce` after every
    ``backward()``, before the optimizer step. ``module`` must be sharded
    (:func:`is_sharded`); its layout is checked here, before any computation."""

    def __init__(self, module: nn.Module) -> None:
        modules = sharded_modules(module)
        _check_layout(modules)
        self.module = module
        states = [m._get_fsdp_state() for m in modules]
        self.groups = [g for s in states for g in _groups(s)]
        if any(g in _HELD for g in self.groups):
            raise GradientError("penalty_step is already active on this module: do not nest it.")
        self.saved = ([_Saved.of(g, _GROUP_HOLD) for g in self.groups]
                      + [_Saved.of(s, _STATE_HOLD) for s in states])
        self.reduces = [g.reduce_grads for g in self.groups]
        self._hold()

    def _hold(self) -> None:
        _HELD.update(self.groups)
        for saved in self.saved:
            saved.hold()

    def _restore(self) -> None:
        for saved in self.saved:
            saved.restore()
        for group in self.groups:
            _HELD.discard(group)

    def release(self) -> None:
        """Give the module its own settings back (no reduction)."""
        self._restore()

    def reduce(self) -> None:
        """FSDP's post-backward for every group, once, after the step's backwards: the
        reduce-scatter of the accumulated unsharded gradients into the sharded ``.grad`` (where
        gradient sync is on) and the reshard the group is configured with; then the check of
        the outcome (module docstring). The hold goes on."""
        self._restore()
        try:
            self._reduce_once()
        finally:
            self._hold()

    def _reduce_once(self) -> None:
        received = [[p for p in g.fsdp_params if _received_gradient(p)] for g in self.groups]
        trainable = [p for g in self.groups for p in g.fsdp_params
                     if p.sharded_param.requires_grad]
        for group in reversed(self.groups):  # backward order, as FSDP's own final callback
            group.post_backward()
            group._training_state = type(group._training_state).IDLE
        if self.module._get_fsdp_state()._state_ctx.is_last_backward:
            for group in self.groups:
                group.finalize_backward()
        if trainable and not any(received):
            raise GradientError(
                f"no parameter of the sharded {type(self.module).__name__} received a gradient "
                "inside penalty_step: call backward() inside the `with` block (the step "
                "reduces the gradients once, when the block ends)."
            )
        lost = [p._param_fqn for reduces, got in zip(self.reduces, received, strict=True)
                if reduces for p in got if p.sharded_param.grad is None]
        if lost:
            raise GradientError(
                f"the gradients of {', '.join(map(str, lost))} were computed but not reduced "
                "into the sharded parameters' .grad: this torch's FSDP2 differs from the one "
                f"penalty_step was verified on (torch 2.13). Use {_APPROXIMATE}."
            )


@contextmanager
def penalty_step(module: nn.Module) -> Iterator[None]:
    """Run the block (forwards, penalties, ``backward()``) as one exact step of ``module``.

    ``module``: the module whose parameters the step differentiates, sharded by ``fully_shard``
    (it or its submodules); the root of the sharded tree. On a module that is not sharded (one
    process, DDP) it does nothing, so one training loop serves all. See the module docstring
    for what it does, its memory, the layouts it refuses and the checks on leaving.
    """
    if not is_sharded(module):
        yield
        return
    held = HeldStep(module)
    try:
        yield
        held.reduce()
    finally:
        held.release()


def check_penalty_graph(outputs: Tensor) -> None:
    """Raise where the graph of ``outputs`` (what a penalty differentiates with
    ``create_graph=True``) runs through an FSDP2-sharded module outside :func:`penalty_step`:
    there FSDP2 either fails in the outer backward or leaves every ``.grad`` None. Cheap where
    no process group is initialized (one process: nothing to walk)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    unheld = {getattr(node, "param_group", None) for node in walk_backward_graph([outputs]).nodes
              if type(node).__name__ == _POST_BACKWARD_NODE}
    unheld = {group for group in unheld if group is not None and group not in _HELD}
    if unheld:
        names = sorted(str(getattr(g, "_module_fqn", None) or "the root") for g in unheld)
        raise GradientError(
            f"a double-backward penalty through fully_shard modules ({', '.join(names)}) "
            "outside gradreg.sharding.penalty_step: FSDP2 would free the parameters the outer "
            "backward needs, or reduce the gradients before they exist (every .grad None). Run "
            "the forward, the penalty and backward() inside `with "
            f"gradreg.sharding.penalty_step(module):`, or use {_APPROXIMATE}."
        )
