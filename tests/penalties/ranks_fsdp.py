"""One rank of a parameter penalty over 2 gloo ranks on an FSDP2 module in plain PyTorch
(``python -m tests.penalties.ranks_fsdp OUT`` with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set):
the MLP of :func:`~tests.penalties.ranks_problem.problem` sharded by ``fully_shard``, each rank
with its half of the batch in two micro-batches, ``accumulated_backward(..., over_ranks=True)``
on ``gathered_parameters`` inside ``penalty_step``; rank 0 saves the full gradient per method."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from gradreg import sharding
from gradreg.penalties import param_grad_norm
from gradreg.penalties.accumulation import accumulated_backward
from tests.distributed import end_rank
from tests.one_rank_fsdp import shard
from tests.penalties.ranks_problem import METHODS, STEP, WEIGHT, problem


def sharded_step(method: str, rank: int, world: int) -> torch.Tensor:
    model, x, y = problem()
    model = shard(model, init_device_mesh("cpu", (world,)))
    share = len(x) // world
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]

    def loss(rows: slice) -> torch.Tensor:
        return F.cross_entropy(model(xs[rows]), ys[rows])

    half = share // 2
    with sharding.penalty_step(model):
        params = sharding.gathered_parameters(model)
        options = {"step": STEP} if method == "finite_difference" else {}
        accumulated_backward(param_grad_norm(WEIGHT, method=method, **options),
                             [partial(loss, slice(0, half)), partial(loss, slice(half, share))],
                             params, rows=[half, share - half], on=(xs,), over_ranks=True)
    return torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {method: sharded_step(method, rank, world) for method in METHODS}
    if rank == 0:
        torch.save(results, out / "fsdp.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_rank()
