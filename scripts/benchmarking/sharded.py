"""Memory per rank of a gradient-penalty step on an FSDP2-sharded critic, beside the unsharded
critic (``scripts/benchmark.py --sharded``).

Two ranks (gloo, CPU) each train an MLP critic ``64 -> W -> W -> W -> 1`` (tanh) with Adam on
a Wasserstein loss plus R1 (weight 1) at the reals, batch 64 per rank. Each rank measures, per
setup:

* ``at_rest_mb``: the parameters and Adam's two moments this rank holds between steps (the
  local shards when sharded);
* ``step_mb``: the peak growth of tensor memory during one forward + backward (gradients freed
  before), from the profiler's allocation events as in ``timing.peak_memory``: activations, the
  penalty's graph, the gradients, and for the sharded critic the gathered parameters;
* ``total_mb``: their sum, the rank's peak.

Setups: ``unsharded`` (the critic whole on each rank, as DDP holds it; no communication),
``sharded_task`` (``fully_shard`` on each Linear and the root, the Wasserstein loss only:
FSDP2's own first-order step), ``sharded_exact`` (R1 by double backward inside
:func:`gradreg.sharding.penalty_step`), ``sharded_fd`` (R1 by finite differences, plain
FSDP2: parameters gathered and freed layer by layer).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from gradreg.penalties import as_points, r1
from gradreg.sharding import penalty_step

WORLD, BATCH, FEATURES = 2, 64, 64
SETUPS = ("unsharded", "sharded_task", "sharded_exact", "sharded_fd")


def critic(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), nn.Linear(width, width),
                         nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def build(setup: str, width: int) -> nn.Module:
    model = critic(width)
    if setup == "unsharded":
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def local_bytes(tensors: list[Tensor]) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def step(setup: str, model: nn.Module, real: Tensor, fake: Tensor) -> None:
    """One forward + backward of ``setup``."""
    with penalty_step(model):
        loss = model(fake).mean() - model(real).mean()
        if setup == "sharded_fd":
            loss = loss + r1(1.0, method="finite_difference")(lambda q: model(q)[:, 0],
                                                              as_points(real))
        elif setup != "sharded_task":
            points = as_points(real)
            loss = loss + r1(1.0)(model(points), points)
        loss.backward()


def measure(setup: str, width: int, rank: int) -> dict:
    from benchmarking.timing import peak_memory

    model = build(setup, width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    real, fake = (torch.randn(BATCH, FEATURES, generator=generator) for _ in range(2))
    for _ in range(2):  # Adam's moments exist after the first step
        optimizer.zero_grad(set_to_none=True)
        step(setup, model, real, fake)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step_bytes = peak_memory(lambda: step(setup, model, real, fake), torch.device("cpu"))
    moments = [v for state in optimizer.state.values() for k, v in state.items()
               if k in ("exp_avg", "exp_avg_sq")]
    at_rest = local_bytes(list(model.parameters()) + moments)
    parameters = sum(p.numel() for p in critic(width).parameters())
    return {"setup": setup, "width": width, "parameters": parameters, "rank": rank,
            "at_rest_mb": at_rest / 2**20, "step_mb": step_bytes / 2**20,
            "total_mb": (at_rest + step_bytes) / 2**20}


def rank_main(rank: int, widths: list[int], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    rows = [measure(setup, width, rank) for width in widths for setup in SETUPS]
    Path(out, f"sharded.rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def markdown(rows: list[dict]) -> str:
    """One line per width and setup: the largest of the ranks' figures."""
    lines = ["| width | parameters | setup | at rest MB | step MB | total MB | total / unsharded |",
             "|---|---|---|---|---|---|---|"]
    for width in sorted({r["width"] for r in rows}):
        worst = {s: max((r for r in rows if r["width"] == width and r["setup"] == s),
                        key=lambda r: r["total_mb"]) for s in SETUPS}
        for s, r in worst.items():
            lines.append(f"| {width} | {r['parameters']:,} | {s} | {r['at_rest_mb']:.2f} | "
                         f"{r['step_mb']:.2f} | {r['total_mb']:.2f} | "
                         f"{r['total_mb'] / worst['unsharded']['total_mb']:.2f} |")
    return "\n".join(lines) + "\n"


def main(out: Path, quick: bool) -> list[dict]:
    """Run both ranks; write ``sharded.json`` and ``sharded.md`` into ``out``; the rows."""
    widths = [64] if quick else [256, 1024, 2048]
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(widths, port, str(out)), nprocs=WORLD)
    rows = [row for rank in range(WORLD)
            for row in json.loads((out / f"sharded.rank{rank}.json").read_text())]
    from benchmarking.report import machine

    (out / "sharded.json").write_text(json.dumps(
        {"machine": machine(torch.device("cpu")), "world": WORLD, "batch": BATCH,
         "rows": rows}, indent=1))
    (out / "sharded.md").write_text(markdown(rows))
    print(markdown(rows))
    return rows
