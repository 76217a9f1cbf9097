"""Memory per rank of a parameter penalty on sharded parameters, DeepSpeed's ZeRO-2 and ZeRO-3
and FSDP2 (run under ``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 -m
tests.reliability.sharded_memory [ZeRO-2 ZeRO-3 FSDP2]``, all three where none is named;
FSDP2 alone needs no DeepSpeed): the peak growth of tensor memory during one optimizer step of
2 micro-batches (forwards, backwards, the optimizer's step) of an MLP, its task loss alone and
with ``sam`` (a finite difference) as each engine takes it: over DeepSpeed's engine through
:class:`~gradreg.integrations.engine_penalty.EnginePenalty` as it runs (ZeRO-3: on each rank's
partitions, :class:`~gradreg.integrations.zero_sharded.ShardedStep`) and, under ZeRO-3, with
the penalty's passes on the unwrapped module and its gradient handed to the parameters gathered
whole (the way fp16, bf16 and an offloaded optimizer take); on FSDP2 (``fully_shard`` on each
layer and the root) through :class:`~gradreg.sharding.ShardedPenalty` (each rank's shards) and
with the parameters gathered whole for the step (:func:`~gradreg.sharding.penalty_step` and
``accumulated_backward(..., over_ranks=True)``). From the profiler's allocation events
(``scripts/benchmarking/timing.peak_memory``), ZeRO's reduce and prefetch buckets of 1e7
elements. Over 5 steps and both ranks: the lowest peak, the same in every run, and the highest
(a step's peak is at times one weight matrix higher). Beside them the rank's own parameters in
float32 (ZeRO-2: all of them; ZeRO-3: its partition; FSDP2: its shards) and each penalty's
extra in units of them (the lowest peaks' difference). Rank 0 prints a Markdown row per engine
and width."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from benchmarking.timing import peak_memory

from gradreg import sharding
from gradreg.integrations.engine_penalty import EnginePenalty
from gradreg.penalties import GradientPenalty, accumulated_backward, sam

ENGINES = ("ZeRO-2", "ZeRO-3", "FSDP2")
WIDTHS = (1024, 2048)
ROWS = 64  # per rank, in 2 micro-batches
REPEATS = 5  # steps measured, after the first
BUCKET = 10**7  # elements of ZeRO's buffers (its default reduce bucket, 5e8, is 2 GB of float32)
#: the step's ways: the task alone, sam on the shards as the entry takes it, sam with the
#: parameters gathered whole (ZeRO-3: the passes on the unwrapped module; FSDP2: penalty_step)
WAYS = ("task", "sam", "whole")


def zero(stage: int) -> dict:
    """ZeRO ``stage``'s section of the engine's configuration, its buffers of ``BUCKET``."""
    buckets = {2: {"allgather_bucket_size": BUCKET},
               3: {"stage3_prefetch_bucket_size": BUCKET}}[stage]
    return {"stage": stage, "reduce_bucket_size": BUCKET, **buckets}


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 1))


def loss_of(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor
            ) -> Callable[[nn.Module], torch.Tensor]:
    return lambda module: F.mse_loss(module(x[rows]), y[rows])


def zero_step(width: int, stage: int, way: str, penalty: GradientPenalty
              ) -> tuple[int, int, Callable[[], None]]:
    """(parameters, of them held by this rank at rest, one optimizer step) of ZeRO ``stage``,
    the step taken ``way`` (:data:`WAYS`)."""
    import deepspeed

    model = mlp(width)
    count = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": ROWS // 2, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
        "zero_optimization": zero(stage),
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    # ZeRO-3 keeps each parameter's partition in ds_tensor; ZeRO-2 keeps every parameter whole
    held = sum(p.ds_tensor.ds_numel if hasattr(p, "ds_tensor") else p.numel()
               for p in model.parameters())
    x, y = torch.randn(ROWS, 2), torch.randn(ROWS, 1)
    sharpness = None if way == "task" else EnginePenalty(engine, penalty)
    if way == "whole":
        sharpness.sharded = None  # the passes on the unwrapped module, gathered whole

    def step() -> None:
        for rows in torch.arange(ROWS).chunk(2):
            if sharpness is None:
                engine.backward(loss_of(x, y, rows)(engine))
            else:
                sharpness.backward(loss_of(x, y, rows), on=(x,))
            engine.step()

    return count, held, step


def fsdp_step(width: int, way: str, penalty: GradientPenalty
              ) -> tuple[int, int, Callable[[], None]]:
    """(parameters, of them held by this rank at rest, one optimizer step) of FSDP2 (each
    layer and the root sharded by ``fully_shard``), the step taken ``way`` (:data:`WAYS`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    model = mlp(width)
    count = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        held = sum(p.to_local().numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(ROWS, 2), torch.randn(ROWS, 1)
    parts = [loss_of(x, y, rows) for rows in torch.arange(ROWS).chunk(2)]
    sharpness = sharding.ShardedPenalty(model, penalty, micro_batches=2) if way == "sam" \
        else None

    def step() -> None:
        if way == "whole":
            with sharding.penalty_step(model):
                params = sharding.gathered_parameters(model)
                accumulated_backward(penalty, [lambda part=part: part(model) for part in parts],
                                     params, rows=[ROWS // 2] * 2, on=(x,), over_ranks=True)
        else:
            for part in parts:
                if sharpness is None:
                    (part(model) / 2).backward()
                else:
                    sharpness.backward(part, on=(x,))
        optimizer.step()
        optimizer.zero_grad()

    return count, held, step


def measure(engine: str, width: int, way: str) -> tuple[int, int, int, int]:
    """(parameters, of them held by this rank at rest, the lowest and the highest peak bytes
    of the step's tensors above those alive before it, over ``REPEATS`` steps and the ranks) of
    ``engine`` (:data:`ENGINES`), the step taken ``way`` (:data:`WAYS`)."""
    penalty = sam(0.05)
    count, held, step = fsdp_step(width, way, penalty) if engine == "FSDP2" \
        else zero_step(width, int(engine[-1]), way, penalty)

    def due_step() -> None:
        penalty.due()
        step()

    due_step()  # the optimizer's buffers made
    peaks = []
    for _ in range(REPEATS):
        gc.collect()  # no garbage of earlier steps or engines freed inside the measured step
        peaks.append(peak_memory(due_step, torch.device("cpu")))
    lowest, highest = torch.tensor(min(peaks)), torch.tensor(max(peaks))
    torch.distributed.all_reduce(lowest, torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(highest, torch.distributed.ReduceOp.MAX)
    return count, held, int(lowest), int(highest)


def main(engines: Sequence[str]) -> None:
    torch.set_num_threads(1)
    rows = []
    for engine in engines:
        for width in WIDTHS:
            peaks = {}
            for way in WAYS if engine != "ZeRO-2" else WAYS[:2]:
                count, held, *peaks[way] = measure(engine, width, way)
            cells = [f"{low / 1e6:.1f} MB (to {high / 1e6:.1f})" for low, high in peaks.values()]
            extra = [f"{(low - peaks['task'][0]) / (4 * held):.1f}"
                     for low, _ in list(peaks.values())[1:]]
            rows.append(f"| {engine} | MLP width {width} ({count / 1e6:.1f} M, "
                        f"{4 * count / 1e6:.1f} MB) | {4 * held / 1e6:.1f} MB | "
                        + " | ".join(cells + ["-"] * (len(WAYS) - len(cells)))
                        + " | " + " | ".join(extra + ["-"] * (len(WAYS) - 1 - len(extra)))
                        + " |")
    if torch.distributed.get_rank() == 0:
        print("\n".join(rows))


if __name__ == "__main__":
    unknown = sorted(set(sys.argv[1:]) - set(ENGINES))
    if unknown:
        sys.exit(f"error: unknown engines {unknown}; name some of {', '.join(ENGINES)}")
    main(sys.argv[1:] or ENGINES)
    sys.stdout.flush()
    os._exit(0)  # the interpreter's teardown aborted now and then (a thread still running)
