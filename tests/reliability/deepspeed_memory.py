"""Memory per rank of a parameter penalty over DeepSpeed's engine, ZeRO-2 and ZeRO-3 (run under
``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 -m tests.reliability.deepspeed_memory``):
the peak growth of tensor memory during one optimizer step of 2 micro-batches (forwards,
backwards, ``engine.step``) of an MLP, its task loss alone (``engine.backward``) and with
``sam`` (a finite difference, which ZeRO-3 takes) through
:class:`~gradreg.integrations.engine_penalty.EnginePenalty` as it runs (ZeRO-3: on each rank's
partitions, :class:`~gradreg.integrations.zero_sharded.ShardedStep`) and, under ZeRO-3, with
the penalty's passes on the unwrapped module and its gradient handed to the parameters gathered
whole (the way fp16, bf16 and an offloaded optimizer take), from the profiler's allocation
events (``scripts/benchmarking/timing.peak_memory``), ZeRO's reduce and prefetch buckets of
1e7 elements. Over 5 steps and both ranks: the lowest peak, the same in every run, and the
highest (a step's peak is at times one weight matrix higher). Beside them the rank's own
parameters in float32 (ZeRO-2: all of them; ZeRO-3: its partition) and each penalty's extra in
units of them (the lowest peaks' difference). Rank 0 prints a Markdown row per stage and
width."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from benchmarking.timing import peak_memory

from gradreg.integrations.engine_penalty import EnginePenalty
from gradreg.penalties import sam

STAGES = (2, 3)
WIDTHS = (1024, 2048)
ROWS = 64  # per rank, in 2 micro-batches
REPEATS = 5  # steps measured, after the first
BUCKET = 10**7  # elements of ZeRO's buffers (its default reduce bucket, 5e8, is 2 GB of float32)
#: the step's ways: the task alone, sam as EnginePenalty takes it, sam gathered whole (ZeRO-3)
WAYS = ("task", "sam", "whole")


def zero(stage: int) -> dict:
    """ZeRO ``stage``'s section of the engine's configuration, its buffers of ``BUCKET``."""
    buckets = {2: {"allgather_bucket_size": BUCKET},
               3: {"stage3_prefetch_bucket_size": BUCKET}}[stage]
    return {"stage": stage, "reduce_bucket_size": BUCKET, **buckets}


def measure(width: int, stage: int, way: str) -> tuple[int, int, int, int]:
    """(parameters, of them held by this rank at rest, the lowest and the highest peak bytes
    of the step's tensors above those alive before it, over ``REPEATS`` steps and the ranks),
    the step taken ``way`` (:data:`WAYS`)."""
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, 1))
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
    penalty = sam(0.05)
    sharpness = None if way == "task" else EnginePenalty(engine, penalty)
    if way == "whole":
        sharpness.sharded = None  # the passes on the unwrapped module, gathered whole

    def step() -> None:
        penalty.due()
        for rows in torch.arange(ROWS).chunk(2):
            def loss(module: nn.Module, rows: torch.Tensor = rows) -> torch.Tensor:
                return F.mse_loss(module(x[rows]), y[rows])

            if sharpness is None:
                engine.backward(loss(engine))
            else:
                sharpness.backward(loss, on=(x,))
            engine.step()

    step()  # the optimizer's buffers made
    peaks = []
    for _ in range(REPEATS):
        gc.collect()  # no garbage of earlier steps or engines freed inside the measured step
        peaks.append(peak_memory(step, torch.device("cpu")))
    lowest, highest = torch.tensor(min(peaks)), torch.tensor(max(peaks))
    torch.distributed.all_reduce(lowest, torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(highest, torch.distributed.ReduceOp.MAX)
    return count, held, int(lowest), int(highest)


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for stage in STAGES:
        for width in WIDTHS:
            peaks = {}
            for way in WAYS if stage == 3 else WAYS[:2]:
                count, held, *peaks[way] = measure(width, stage, way)
            cells = [f"{low / 1e6:.1f} MB (to {high / 1e6:.1f})" for low, high in peaks.values()]
            extra = [f"{(low - peaks['task'][0]) / (4 * held):.1f}"
                     for low, _ in list(peaks.values())[1:]]
            rows.append(f"| ZeRO-{stage} | MLP width {width} ({count / 1e6:.1f} M, "
                        f"{4 * count / 1e6:.1f} MB) | {4 * held / 1e6:.1f} MB | "
                        + " | ".join(cells + ["-"] * (len(WAYS) - len(cells)))
                        + " | " + " | ".join(extra + ["-"] * (len(WAYS) - 1 - len(extra)))
                        + " |")
    if torch.distributed.get_rank() == 0:
        print("\n".join(rows))


if __name__ == "__main__":
    main()
