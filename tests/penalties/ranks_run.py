"""One rank of the penalty of a batch split over 2 gloo ranks (``python -m
tests.penalties.ranks_run OUT`` with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set): each rank
takes its half of the batch of :func:`problem`, in two micro-batches, through
``accumulated_backward(..., over_ranks=True)``, and saves the gradient and the values it
reached per method; then ``penalized_backward`` and ``accumulated_backward`` through the model
wrapped in DDP (their gradient accumulated by autograd, so that DDP's reducer averages it)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.distributed import end_rank
from tests.penalties.ranks_problem import METHODS, OWN_STEPS, own_step, problem, step


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for method in METHODS:
        model, x, y = problem()
        share = len(x) // world
        rows = slice(rank * share, (rank + 1) * share)
        results[method] = step(model, x[rows], y[rows], method, micro_batches=2,
                               over_ranks=True)
        # unequal shares: 5 rows on rank 0 (one micro-batch), 11 on rank 1 (4 + 7)
        mine = slice(0, 5) if rank == 0 else slice(5, 16)
        results[f"unequal_{method}"] = step(problem()[0], x[mine], y[mine], method,
                                            sizes=[5] if rank == 0 else [4, 7], over_ranks=True)
    rows = slice(rank * share, (rank + 1) * share)
    for how in OWN_STEPS:
        model, x, y = problem()
        results[f"ddp_{how}"] = own_step(model, DistributedDataParallel(model), x[rows], y[rows],
                                         how)
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_rank()
