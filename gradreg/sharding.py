r"""Exact gradient penalties on FSDP2-sharded modules: :func:`penalty_step` around the step;
and :class:`ShardedPenalty`, a parameter penalty's finite difference (``sam``, ``gr``,
``param_grad_norm(method="finite_difference")``) of the whole batch's gradient on each rank's
shards, the parameters never gathered whole (its extra memory one buffer of the rank's shard).

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from gradreg import torch_compat as compat
from gradreg.autograd import GradientError
from gradreg.graph import walk_backward_graph

if TYPE_CHECKING:
    from gradreg.penalties import GradientPenalty

__all__ = [
    "FSDP_MIN_TORCH",
    "HeldStep",
    "ModuleShards",
    "ShardedPenalty",
    "check_penalty_graph",
    "gathered_parameters",
    "held_unsharded",
    "is_sharded",
    "penalty_step",
    "sharded_modules",
    "supports_exact_step",
]

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


class ModuleShards:
    """FSDP2's sharded ``module`` as :class:`~gradreg.penalties.shards.ShardedStep` reads and
    writes it (:class:`~gradreg.penalties.shards.Shards`): each parameter a ``DTensor`` whose
    local tensor is this rank's shard (``Shard(0)``: disjoint rows, the next all-gather reads
    it, as an optimizer's update), its ``.grad`` a ``DTensor`` whose local tensor holds the
    reduce-scattered mean over the ranks, added to by each backward; the second pass runs
    ``module``'s forward and ``backward()`` of the loss over ``micro_batches``. A module that
    is not sharded, in one process, is its own single shard (``group`` None: no all-reduce).
    ``params``: the penalized parameters, then the others; those of the others that got no
    gradient in the step are left without one."""

    name = "ShardedPenalty"

    def __init__(self, module: nn.Module, params: Sequence[Tensor], count: int,
                 micro_batches: int) -> None:
        self.module, self.target, self.params, self.count = module, module, list(params), count
        self.micro_batches = micro_batches
        self.group = params[0].device_mesh.get_group() if _is_dtensor(params[0]) else None
        self._listed: list[Tensor] | None = None  # the parameters with a gradient this step

    def entries(self) -> int:
        return sum(p.numel() for p in self.params[:self.count])

    def gradients(self) -> list[Tensor]:
        if self._listed is None:
            missing = [j for j, p in enumerate(self.params[:self.count]) if p.grad is None]
            if missing:
                raise GradientError(
                    f"ShardedPenalty: the penalized parameters {missing[:5]} got no gradient in "
                    "the step's backward: pass params= the parameters the loss depends on.")
            self._listed = [p for p in self.params if p.grad is not None]
        with torch.no_grad():
            return [_local(p.grad) for p in self._listed]

    def set_gradients(self, values: Sequence[Tensor]) -> None:
        listed = set(map(id, self._listed or ()))
        with torch.no_grad():
            torch._foreach_copy_(self.gradients(), list(values))
        for p in self.params:
            if id(p) not in listed:
                p.grad = None  # a parameter the second pass reached and the first did not
        self._listed = None

    def scale_gradients(self, factor: Tensor) -> None:
        with torch.no_grad():
            shards = self.gradients()[:self.count]
            torch._foreach_mul_(shards, factor.to(shards[0].dtype))

    @contextmanager
    def shifted(self, directions: Sequence[Tensor], amount: Tensor) -> Iterator[None]:
        modules = sharded_modules(self.module)
        for module in modules:  # the forwards then gather the shifted shards
            module.reshard()
        with torch.no_grad():
            targets = [_local(p) for p in self.params[:self.count]]
            saved = [t.clone() for t in targets]
            torch._foreach_addcmul_(targets, list(directions),
                                    [amount.to(t.dtype) for t in targets])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(targets, saved)
            for module in modules:  # no gathered copy of the shifted shards is left
                module.reshard()

    def backward(self, loss: Tensor) -> None:
        (loss / self.micro_batches).backward()

    def buffers(self) -> list[Tensor]:
        return list(self.module.buffers())


def _is_dtensor(tensor: Tensor) -> bool:
    sharded = compat.dtensor_type()
    return sharded is not None and isinstance(tensor, sharded)


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of ``tensor`` (a DTensor's local tensor: in-place changes are the
    DTensor's), or ``tensor`` itself where it is not sharded; call under ``no_grad``."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


_TAKEN = ("ShardedPenalty takes the finite differences of the 2-norm along the gradient (sam, "
          "gr, param_grad_norm(method='finite_difference'))")
_HELD_FIX = ("gradreg.sharding.penalty_step takes it, with the parameters gathered whole for "
             "the step (docs: parameter penalties over ranks on FSDP2 modules)")


def _check_taken(penalty: GradientPenalty) -> None:
    """Refuse in one line a penalty :class:`ShardedPenalty` does not take, naming the fix."""
    config = penalty.config
    if config.points != "parameters":
        reason = f"a penalty on points={config.points!r}"
    elif not penalty.needs_callable:
        reason = (f"method={config.method.name!r} differentiates the parameters twice, which "
                  "needs them gathered")
    elif getattr(config.method, "adaptive", False):
        reason = "ASAM's shift scales the gradient by the parameters' magnitudes, read whole"
    elif config.p != 2:
        reason = f"p={config.p} (its direction is not the gradient's)"
    else:
        return
    raise GradientError(f"{_TAKEN}; got {reason}: {_HELD_FIX}.")


class ShardedPenalty:
    r"""``penalty`` (``sam``, ``gr``, ``param_grad_norm(method="finite_difference")``: a finite
    difference of the 2-norm) of the whole step's gradient :math:`\bar g` on an FSDP2 module
    (``fully_shard``), all ranks' shares and ``micro_batches`` micro-batches (each
    micro-batch's mean loss equally weighted), each rank on its own shards: its extra memory
    one buffer of its shard of the parameters, :math:`O(\text{parameters}/W)`::

        sharpness = ShardedPenalty(model, sam(0.05), micro_batches=2)
        for step_batches in batches:
            sharpness.penalty.due()
            for x, y in step_batches:
                sharpness.backward(lambda module: F.cross_entropy(module(x), y), on=(x,))
            optimizer.step()
            optimizer.zero_grad()

    Each :meth:`backward` is the step's own: ``(loss / micro_batches).backward()``, FSDP2's
    reduce-scatter adding into the sharded ``.grad``. After the step's last micro-batch one
    all-reduce of the ranks' sums of squares gives :math:`\lVert \bar g \rVert`, the value
    and the direction :math:`v = 2 P' \bar g`; each rank shifts its shards by :math:`h\,
    v^{(r)}/\lVert v \rVert`, the step's micro-batches run again (their random numbers
    replayed, the buffers kept) and :math:`\bar g + c\,\lVert v \rVert / h\,(\bar g' -
    \bar g)` is left in the shards' ``.grad`` for ``optimizer.step()``; the shards are put
    back bitwise (:class:`~gradreg.penalties.shards.ShardedStep`, the arithmetic DeepSpeed
    ZeRO-3's :class:`~gradreg.integrations.engine_penalty.EnginePenalty` runs too).

    ``params``: the parameters the penalty is of (``module``'s trainable ones where not given;
    the others take the task's gradient alone). ``last_value``: the weighted penalty of the
    latest finished step, the same on every rank. Refused in one line: the exact method (a
    double backward), ASAM, ``p != 2`` and penalties at other points (:func:`penalty_step`
    takes them all, the parameters gathered whole), the layouts :func:`penalty_step` refuses,
    and a module that ``fully_shard`` did not shard on several ranks. In one process a module
    that is not sharded takes the same step, its parameters whole (as in
    :func:`~gradreg.penalties.accumulated_backward`), so one training loop serves both."""

    def __init__(self, module: nn.Module, penalty: GradientPenalty,
                 params: Sequence[Tensor] | None = None, *, micro_batches: int = 1) -> None:
        from gradreg.penalties.shards import ShardedStep

        _check_taken(penalty)
        if micro_batches < 1:
            raise GradientError(f"ShardedPenalty: micro_batches={micro_batches}; it must be >= 1.")
        modules = sharded_modules(module)
        if not modules and torch.distributed.is_available() and \
                torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise GradientError(
                f"ShardedPenalty takes a module sharded by fully_shard (or one process); "
                f"{type(module).__name__} is not sharded, on "
                f"{torch.distributed.get_world_size()} ranks: shard it, or under DDP use "
                "gradreg.penalties.accumulated_backward(..., over_ranks=True).")
        if modules:
            _check_layout(modules)
        chosen = [p for p in module.parameters() if p.requires_grad] if params is None \
            else list(params)
        loose = [j for j, p in enumerate(chosen) if not _is_dtensor(p)] if modules else []
        if loose:
            raise GradientError(
                f"ShardedPenalty: parameters {loose[:5]} of the {len(chosen)} given are not "
                f"sharded by fully_shard: pass parameters of the sharded {type(module).__name__}.")
        ids = set(map(id, chosen))
        others = [p for p in module.parameters() if p.requires_grad and id(p) not in ids]
        self.module, self.penalty, self.params = module, penalty, chosen
        self.micro_batches = micro_batches
        self.step = ShardedStep(ModuleShards(module, chosen + others, len(chosen), micro_batches),
                                penalty, len(chosen))
        self.last_value: Tensor | None = None
        self._taken = 0  # micro-batches of this step so far

    def backward(self, loss_of: Callable[[nn.Module], Tensor], *,
                 on: Sequence[Tensor] = ()) -> Tensor:
        """One micro-batch: ``loss_of(module)`` is its mean loss computed by calling
        ``module``; ``on`` the batch's tensors whose devices' random states are replayed in the
        second pass. Runs its backward, and on the step's ``micro_batches``-th the penalty's
        second pass (the user then calls ``optimizer.step()``); returns the detached loss.
        Call it on every micro-batch of a step where the penalty is due (``penalty.due()``,
        once per step), else ``(loss / micro_batches).backward()``."""
        from gradreg.penalties import GeneratorState

        self.penalty._check_due()
        state = GeneratorState.capture(*on, *self.params)
        loss = loss_of(self.module)
        self.step.add(loss_of, state, loss)
        (loss / self.micro_batches).backward()
        self._taken += 1
        if self._taken == self.micro_batches:
            self._taken = 0
            self.last_value = self.step.finish()
        return loss.detach()
