r"""A repeated forward that leaves the modules' buffers as the first forward left them.

A penalty that runs the model again on the same batch (the forward at shifted parameters of
``param_grad_norm`` by finite difference, SAM) must leave the model's state as *one* forward
would: BatchNorm in training mode updates its running mean and variance and counts
``num_batches_tracked`` at every forward, so a second forward would count the step twice and
move the running statistics by the momentum twice (towards the statistics at the shifted
parameters, which are not the model's).

:func:`buffers_kept` runs a block under a global module forward pre-hook: each module that runs
in it has its buffers' version counters noted, and those of normalization layers with running
statistics (``nn.modules.batchnorm._NormBase``: BatchNorm, SyncBatchNorm, InstanceNorm with
``track_running_stats``, gradreg's BatchNorm) copied, before it runs. After the block the copies
are written back (bitwise). A buffer of any other module written in place in the block (a
spectral normalization's power-iteration vector, a running mean of one's own) cannot be put back
without a copy of every buffer of every module at every step: it is refused by a
:class:`~gradreg.GradientError` naming the module and the buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.module import register_module_forward_pre_hook

from gradreg.autograd import GradientError

__all__ = ["buffers_kept"]


@contextmanager
def buffers_kept(what: str) -> Iterator[None]:
    """Run the block; then restore the buffers of the normalization layers that ran in it, and
    raise where another module's buffer was written in place (``what``: the computation, for
    the message)."""
    saved: dict[int, tuple[nn.Module, dict[str, Tensor]]] = {}
    versions: dict[int, tuple[nn.Module, dict[str, int]]] = {}

    def note(module: nn.Module, args: object) -> None:
        key = id(module)
        if key in versions or not module._buffers:
            return
        buffers = {name: b for name, b in module._buffers.items() if b is not None}
        versions[key] = (module, {name: b._version for name, b in buffers.items()})
        if isinstance(module, _NormBase):
            saved[key] = (module, {name: b.clone() for name, b in buffers.items()})

    handle = register_module_forward_pre_hook(note)
    try:
        yield
    finally:
        handle.remove()
        with torch.no_grad():
            for module, copies in saved.values():
                for name, copy in copies.items():
                    module._buffers[name].copy_(copy)
    for key, (module, before) in versions.items():
        if key in saved:
            continue
        written = [name for name, version in before.items()
                   if module._buffers.get(name) is not None
                   and module._buffers[name]._version != version]
        if written:
            raise GradientError(
                f"{what} runs the model again, and {type(module).__name__} wrote its buffer(s) "
                f"{written} in place during that forward (a second update per step): put the "
                "module in eval mode, or use method='double_backward' (one forward).")
