"""FSDP2 in the test process: a process group of one rank (gloo, CPU) and ``fully_shard`` on a
model's layers and root, for the one-process tests of ``gradreg.sharding`` and
``gradreg.torch_compat`` (the 2-rank tests are in tests/reliability/test_fsdp.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@contextmanager
def one_rank() -> Iterator[DeviceMesh]:
    """A process group of this process alone while the block runs; its 1-D CPU mesh."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def shard(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` on every submodule with parameters of its own, then on ``model`` (torch
    before 2.6 has it only under ``torch.distributed._composable.fsdp``)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    for sub in list(model.modules())[1:]:
        if any(True for _ in sub.parameters(recurse=False)):
            fully_shard(sub, mesh=mesh)
    return fully_shard(model, mesh=mesh)
