"""One rank of :class:`gradreg.sharding.ShardedPenalty` on an FSDP2 module over 2 gloo ranks
(``python -m tests.penalties.ranks_fsdp_sharded OUT`` with ``RANK``/``WORLD_SIZE``/``MASTER_*``
set): the MLP with dropout of :func:`~tests.penalties.ranks_zero_sharded.problem` sharded by
``fully_shard`` (each layer and the root; the last layer's 3 rows split 2 + 1), each rank's share
of a batch of 16 in two micro-batches, two SGD steps per case (:data:`CASES`: ``sam``, ``gr``,
the finite-difference ``param_grad_norm``, the penalty of the last layer alone) and dtype;
saves the parameters after them, the last step's penalty value and whether each step put the
rank's shards back bitwise. The one-process reference is
:func:`~tests.penalties.ranks_zero_sharded.reference`, the same steps with the whole batch."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from gradreg.sharding import ShardedPenalty
from tests.distributed import end_rank
from tests.one_rank_fsdp import shard
from tests.penalties.ranks_zero_sharded import (
    LR,
    MICRO_BATCHES,
    PENALTIES,
    ROWS,
    STEPS,
    problem,
    seed,
)

#: case -> (penalty, whether it is of the last layer's parameters alone)
CASES = {"sam": ("sam", False), "gr": ("gr", False), "gnp": ("gnp", False),
         "sam_last_layer": ("sam", True)}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def sharded_steps(case: str, dtype: torch.dtype, rank: int, world: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The parameters after the steps (gathered whole), the last step's penalty value, and
    whether every step's penalty left the rank's shards bitwise as they were."""
    name, last_layer = CASES[case]
    model, x, y = problem(dtype)
    model = shard(model, init_device_mesh("cpu", (world,)))
    share = ROWS // world
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    penalty = ShardedPenalty(model, PENALTIES[name](),
                             list(model[-1].parameters()) if last_layer else None,
                             micro_batches=MICRO_BATCHES)
    params, restored = list(model.parameters()), True
    for step in range(STEPS):
        penalty.penalty.due()
        with torch.no_grad():
            before = [p.to_local().clone() for p in params]
        for k, rows in enumerate(torch.arange(share).chunk(MICRO_BATCHES)):
            torch.manual_seed(seed(step, rank * MICRO_BATCHES + k))  # replayed by the penalty
            penalty.backward(lambda module, rows=rows: F.cross_entropy(module(xs[rows]),
                                                                       ys[rows]), on=(xs,))
        with torch.no_grad():
            restored &= all(torch.equal(b, p.to_local()) for b, p in zip(before, params,
                                                                          strict=True))
        optimizer.step()
        optimizer.zero_grad()
    full = torch.cat([p.detach().full_tensor().flatten() for p in params])
    return full, penalty.last_value, torch.tensor(restored)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save({(case, dtype): sharded_steps(case, DTYPES[dtype], rank, world)
                for case in CASES for dtype in DTYPES}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_rank()
