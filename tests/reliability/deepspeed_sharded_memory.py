"""Memory per rank of ``sam`` over DeepSpeed ZeRO-3's engine, its finite difference on each rank's
partitions against the parameters gathered whole (run under ``DS_ACCELERATOR=cpu torchrun
--nproc_per_node 2 -m tests.reliability.deepspeed_sharded_memory``): the peak growth of tensor
memory during one optimizer step of 2 micro-batches (forwards, backwards, ``engine.step``) of an
MLP, from the profiler's allocation events (``scripts/benchmarking/timing.peak_memory``; the
median of 5 steps after the first), ZeRO's reduce and prefetch buckets of 1e7 elements: the
task loss alone (``engine.backward``), :class:`~gradreg.integrations.engine_penalty.EnginePenalty`
with ``sam`` as it runs (:class:`~gradreg.integrations.zero_sharded.ShardedStep`), and the same
with the penalty's passes on the unwrapped module and its gradient handed to the parameters
gathered whole (``sharded = None``). Beside them the rank's partition of the parameters in
float32 (its shard) and each penalty's extra peak in units of it. Rank 0 prints a Markdown row
per width."""

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

WIDTHS = (1024, 2048)
ROWS = 64  # per rank, in 2 micro-batches
REPEATS = 5  # steps measured, after the first
BUCKET = 10**7  # elements of ZeRO's buffers (its default reduce bucket, 5e8, is 2 GB of float32)
WAYS = ("plain", "sharded", "whole")


def measure(width: int, way: str) -> tuple[int, int, int]:
    """(parameters, of them in this rank's partitions, peak bytes of the step's tensors above
    those alive before it: the median over ``REPEATS`` steps), the step taken ``way``
    (:data:`WAYS`)."""
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, 1))
    count = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": ROWS // 2, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": BUCKET,
                              "stage3_prefetch_bucket_size": BUCKET},
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    shard = sum(p.ds_tensor.ds_numel for p in model.parameters())
    x, y = torch.randn(ROWS, 2), torch.randn(ROWS, 1)
    penalty = sam(0.05)
    sharpness = None if way == "plain" else EnginePenalty(engine, penalty)
    if way == "whole":
        sharpness.sharded = None

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
    peaks.sort()
    return count, shard, peaks[REPEATS // 2]


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for width in WIDTHS:
        peaks = {}
        for way in WAYS:
            count, shard, peaks[way] = measure(width, way)
        extra = {way: (peaks[way] - peaks["plain"]) / (4 * shard) for way in WAYS[1:]}
        rows.append(f"| MLP width {width} ({count / 1e6:.1f} M, {4 * count / 1e6:.1f} MB) | "
                    f"{4 * shard / 1e6:.1f} MB | {peaks['plain'] / 1e6:.1f} MB | "
                    f"{peaks['sharded'] / 1e6:.1f} MB ({extra['sharded']:.1f}) | "
                    f"{peaks['whole'] / 1e6:.1f} MB ({extra['whole']:.1f}) |")
    if torch.distributed.get_rank() == 0:
        print("\n".join(rows))


if __name__ == "__main__":
    main()
