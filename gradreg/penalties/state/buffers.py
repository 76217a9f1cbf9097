r"""A repeated forward that leaves the modules' buffers as the first forward left them.

A penalty that runs the model again on the same batch (the forward at shifted parameters of
``param_grad_norm`` by finite difference, SAM) must leave the model's state as *one* forward
would: BatchNorm in training mode updates its running mean and variance and counts
``num_batches_tracked`` at every forward, so a second forward would count the step twice and
move the running statistics by the momentum twice (towards the statistics at the shifted
parameters, which are not the model's).

:func:`buffers_kept` runs a block under a global module forward pre-hook: each module that runs
in it has its buffers' version counters noted, and those of normalization layers with running
statistics (:data:`~gradreg.torch_compat.NormBase`: BatchNorm, SyncBatchNorm, InstanceNorm with
``track_running_stats``, gradreg's BatchNorm) set aside, the module running on copies of them.
After the block the buffers themselves are put back: untouched, so their values are bitwise those
the first forward left and their version counters have not moved (a graph of the first forward
that saved them, BatchNorm's, can still be differentiated after the block). A buffer of any
other module written in place in the block (a spectral normalization's power-iteration vector, a
running mean of one's own) cannot be put back without a copy of every buffer of every module at
every step: it is refused by a :class:`~gradreg.GradientError` naming the module and the buffer.

A global hook takes every module call off torch's fast path (about 15% of a small transformer's
forward on CPU), so :class:`KeptBuffers` runs the hook once per set of parameters and then
watches the modules with buffers that it found (the modules a forward runs are those of the
model the parameters belong to).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_pre_hook

from gradreg.autograd import GradientError
from gradreg.torch_compat import NormBase

__all__ = ["KeptBuffers", "buffers_kept"]


@contextmanager
def buffers_kept(what: str, modules: list[nn.Module] | None = None) -> Iterator[list[nn.Module]]:
    """Run the block; then restore the buffers of the normalization layers that ran in it, and
    raise where another module's buffer was written in place (``what``: the computation, for
    the message). ``modules``: the modules with buffers to watch, where known; otherwise the
    block runs under a global forward pre-hook that finds them. Yields the list of the modules
    watched (filled as they run, when found by the hook)."""
    watched: list[nn.Module] = []
    saved: dict[int, dict[str, Tensor]] = {}
    versions: dict[int, dict[str, int]] = {}

    def note(module: nn.Module, args: object = None) -> None:
        key = id(module)
        if key in versions or not module._buffers:
            return
        buffers = {name: b for name, b in module._buffers.items() if b is not None}
        watched.append(module)
        versions[key] = {name: b._version for name, b in buffers.items()}
        if isinstance(module, NormBase):  # the block runs on copies; the buffers stay aside
            saved[key] = buffers
            for name, b in buffers.items():
                module._buffers[name] = b.clone()

    for module in modules or ():
        note(module)
    handle = register_module_forward_pre_hook(note) if modules is None else None
    try:
        yield watched
    finally:
        if handle is not None:
            handle.remove()
        for module in watched:
            module._buffers.update(saved.get(id(module), {}))
    for module in watched:
        if id(module) in saved:
            continue
        written = [name for name, version in versions[id(module)].items()
                   if module._buffers.get(name) is not None
                   and module._buffers[name]._version != version]
        if written:
            raise GradientError(
                f"{what} runs the model again, and {type(module).__name__} wrote its buffer(s) "
                f"{written} in place during that forward (a second update per step): put the "
                "module in eval mode, or use method='double_backward' (one forward).")


class KeptBuffers:
    """:func:`buffers_kept` for repeated calls: the hook runs on the first call for a set of
    parameters (``key``), later calls with the same key watch the modules it found."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._key: tuple[int, ...] | None = None
        self._modules: list[nn.Module] | None = None

    @contextmanager
    def kept(self, params: Sequence[Tensor]) -> Iterator[None]:
        key = tuple(id(p) for p in params)
        known = self._modules if key == self._key else None
        if known == []:  # a model without buffers: nothing to keep
            yield
            return
        with buffers_kept(self.what, known) as watched:
            yield
        self._key, self._modules = key, list(watched)
