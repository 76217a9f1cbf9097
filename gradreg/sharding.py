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
calls their ``post_backward``/``finalize_backward``, which are not public API; it reaches them
only through :mod:`gradreg.torch_compat`, whose tests pin each name. Verified on torch 2.13 and
2.14 by the parity tests; a torch whose FSDP2 no longer reduces here raises (the outcome check
below). :func:`supports_exact_step` says whether this torch runs the step.

Layouts not supported (refused on entering, before any computation): torch older than 2.6
(FSDP2's ``fully_shard`` is public from 2.6), hybrid sharding (a 2-D mesh) and CPU offload
(not verified). On those, or to keep the parameters sharded during the step, use a method with no
double backward, which FSDP2 supports as it is: ``method="finite_difference"`` at the points
(not ``param_grad_norm``'s, which shifts the parameters themselves: it runs inside the step, on
the unsharded parameters the step holds, :func:`held_unsharded`).

Outside the step, :func:`check_penalty_graph` refuses a penalty whose graph runs through an
FSDP2 module that no :func:`penalty_step` holds, before anything is differentiated; every
exact penalty of :mod:`gradreg.penalties` calls it on the outputs it differentiates (on its first
call, and on every call once its graph ran through a sharded module), so neither failure above
reaches a gradreg penalty.

The step also checks its outcome: a parameter that got a gradient during the step and has no
sharded ``.grad`` after it raises :class:`~gradreg.autograd.GradientError` instead of a silent
loss of the update; so does a step in which no parameter that requires grad got a gradient
(the ``backward()`` must run inside the ``with`` block).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from gradreg import torch_compat as compat
from gradreg.autograd import GradientError
from gradreg.graph import walk_backward_graph

__all__ = ["FSDP_MIN_TORCH", "HeldStep", "check_penalty_graph", "gathered_parameters",
           "held_unsharded", "is_sharded", "penalty_step", "sharded_modules",
           "supports_exact_step"]

#: The first torch whose ``torch.distributed.fsdp`` exports ``fully_shard`` (FSDP2).
FSDP_MIN_TORCH = (2, 6)

_APPROXIMATE = "method='finite_difference' (no double backward, FSDP2 supports it as it is)"
_HELD: weakref.WeakSet = weakref.WeakSet()  # the parameter groups inside a penalty_step


def supports_exact_step() -> bool:
    """Whether this torch runs :func:`penalty_step` on sharded modules: torch >= 2.6
    (:data:`FSDP_MIN_TORCH`), where FSDP2's ``fully_shard`` is public."""
    major, minor = torch.__version__.split(".")[:2]
    return (int(major), int(minor)) >= FSDP_MIN_TORCH


def sharded_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules (``fully_shard`` applied) of ``module``'s tree, itself included."""
    fsdp_type = compat.fsdp_module_type()
    if fsdp_type is None:
        return []
    return [m for m in module.modules() if isinstance(m, fsdp_type)]


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or one of its submodules."""
    return bool(sharded_modules(module))


def _check_layout(modules: list[nn.Module]) -> None:
    if not supports_exact_step():
        raise GradientError(
            f"exact gradient penalties on fully_shard modules need torch >= "
            f"{'.'.join(map(str, FSDP_MIN_TORCH))} (torch {torch.__version__} has FSDP2 only "
            f"as a private API). Upgrade torch, or use {_APPROXIMATE}."
        )
    for module in modules:
        for group in compat.fsdp_param_groups(module):
            ndim = compat.fsdp_group_mesh_ndim(group)
            if ndim != 1:
                raise GradientError(
                    f"penalty_step supports fully_shard on a 1-D device mesh; "
                    f"{type(module).__name__} is sharded on a {ndim}-D mesh "
                    f"(hybrid sharding), where the exact step is not verified. Use a 1-D mesh, "
                    f"or {_APPROXIMATE}."
                )
            if compat.fsdp_group_offloads_to_cpu(group):
                raise GradientError(
                    f"penalty_step does not support CPUOffloadPolicy ({type(module).__name__} "
                    f"offloads its parameters), where the exact step is not verified. Remove "
                    f"the offload policy, or use {_APPROXIMATE}."
                )


class HeldStep:
    """The settings of :func:`penalty_step` held on a sharded module until :meth:`release`,
    for loops that call backward themselves (a trainer): call :meth:`reduce` after every
    ``backward()``, before the optimizer step. ``module`` must be sharded
    (:func:`is_sharded`); its layout is checked here, before any computation."""

    def __init__(self, module: nn.Module) -> None:
        modules = sharded_modules(module)
        _check_layout(modules)
        self.module = module
        self.groups = [g for m in modules for g in compat.fsdp_param_groups(m)]
        if any(g in _HELD for g in self.groups):
            raise GradientError("penalty_step is already active on this module: do not nest it.")
        self.saved = [s for m in modules for s in compat.fsdp_step_settings(m)]
        self.reduces = [compat.fsdp_group_reduces_gradients(g) for g in self.groups]
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
        params = [compat.fsdp_group_params(g) for g in self.groups]
        received = [[p for p in ps if compat.fsdp_param_received_gradient(p)] for ps in params]
        trainable = [p for ps in params for p in ps
                     if compat.fsdp_sharded_param(p).requires_grad]
        compat.run_fsdp_post_backward(self.module, self.groups)
        if trainable and not any(received):
            raise GradientError(
                f"no parameter of the sharded {type(self.module).__name__} received a gradient "
                "inside penalty_step: call backward() inside the `with` block (the step "
                "reduces the gradients once, when the block ends)."
            )
        lost = [compat.fsdp_param_name(p)
                for reduces, got in zip(self.reduces, received, strict=True) if reduces
                for p in got if compat.fsdp_sharded_param(p).grad is None]
        if lost:
            raise GradientError(
                f"the gradients of {', '.join(lost)} were computed but not reduced "
                "into the sharded parameters' .grad: this torch's FSDP2 differs from the one "
                f"penalty_step was verified on (torch 2.13 and 2.14). Use {_APPROXIMATE}."
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


def held_unsharded(params: tuple[Tensor, ...], needed_by: str) -> tuple[Tensor, ...]:
    """``params`` with each FSDP2-sharded parameter (a DTensor) replaced by the unsharded
    parameter the module computes with, which :func:`penalty_step` holds gathered: a method
    that shifts the parameters and differentiates w.r.t. them (``needed_by``) works on these,
    as in one process, and the gradient it gives them is reduced when the step ends. Raises
    where a sharded parameter is not held gathered (outside :func:`penalty_step`, or before the
    step's forward)."""
    sharded = compat.dtensor_type()
    if sharded is None or not any(isinstance(p, sharded) for p in params):
        return params
    held = {id(compat.fsdp_sharded_param(fp)): fp
            for group in list(_HELD) for fp in compat.fsdp_group_params(group)}
    unsharded = []
    for param in params:
        fsdp_param = held.get(id(param)) if isinstance(param, sharded) else None
        full = None if fsdp_param is None else compat.fsdp_unsharded_param(fsdp_param)
        if isinstance(param, sharded) and full is None:
            raise GradientError(
                f"{needed_by} on fully_shard parameters works on the parameters "
                "gradreg.sharding.penalty_step holds gathered: run the forward, the penalty and "
                "backward() inside `with gradreg.sharding.penalty_step(module):` (a sharded "
                f"parameter of shape {tuple(param.shape)} is "
                f"{'not held' if fsdp_param is None else 'not gathered: run the forward first'}).")
        unsharded.append(param if full is None else full)
    return tuple(unsharded)


def gathered_parameters(module: nn.Module) -> tuple[Tensor, ...]:
    """The trainable parameters of ``module`` as the held step computes with them: inside
    :func:`penalty_step`, every FSDP2 module of the tree is unsharded (FSDP's public
    ``unshard``, an all-gather; held gathered until the step ends) and its sharded parameters
    replaced by the unsharded ones (:func:`held_unsharded`); on a module that is not sharded,
    its parameters. For the penalties that take the parameters before any forward, over the
    ranks: ``accumulated_backward(..., gathered_parameters(model), rows=[...],
    over_ranks=True)`` inside ``penalty_step(model)`` (docs/scale.md)."""
    params = tuple(p for p in module.parameters() if p.requires_grad)
    modules = sharded_modules(module)
    if modules and not all(g in _HELD for m in modules for g in compat.fsdp_param_groups(m)):
        raise GradientError(
            "gathered_parameters of a fully_shard module works inside "
            "gradreg.sharding.penalty_step(module), which holds them gathered: call it there.")
    for sharded in modules:
        sharded.unshard()
    return held_unsharded(params, "gathered_parameters")


def check_penalty_graph(outputs: Tensor) -> bool:
    """Raise where the graph of ``outputs`` (what a penalty differentiates with
    ``create_graph=True``) runs through an FSDP2-sharded module outside :func:`penalty_step`:
    there FSDP2 either fails in the outer backward or leaves every ``.grad`` None. Returns
    whether the graph runs through FSDP2-sharded modules at all (held or not). Cheap where no
    process group is initialized (one process: nothing to walk)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    groups = {compat.fsdp_group_of_node(node) for node in walk_backward_graph([outputs]).nodes}
    groups.discard(None)
    unheld = {group for group in groups if group not in _HELD}
    if unheld:
        names = sorted(compat.fsdp_group_name(g) for g in unheld)
        raise GradientError(
            f"a double-backward penalty through fully_shard modules ({', '.join(names)}) "
            "outside gradreg.sharding.penalty_step: FSDP2 would free the parameters the outer "
            "backward needs, or reduce the gradients before they exist (every .grad None). Run "
            "the forward, the penalty and backward() inside `with "
            f"gradreg.sharding.penalty_step(module):`, or use {_APPROXIMATE}."
        )
    return bool(groups)
