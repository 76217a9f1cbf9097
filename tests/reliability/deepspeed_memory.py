"""Memory per rank of a parameter penalty over DeepSpeed's engine, ZeRO-2 (run under
``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 -m tests.reliability.deepspeed_memory``):
the peak growth of tensor memory during one optimizer step of 2 micro-batches (forwards,
backwards, ``engine.step``) of an MLP, its task loss alone (``engine.backward``) and with
``sam`` through :class:`~gradreg.integrations.engine_penalty.EnginePenalty`, from the profiler's
allocation events (``scripts/benchmarking/timing.peak_memory``), ZeRO's reduce buckets of 1e7
elements; rank 0 prints a Markdown row per width."""

from __future__ import annotations

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
BUCKET = 10**7  # elements of ZeRO's reduce buffers (its default, 5e8, is 2 GB of float32)


def measure(width: int, penalized: bool) -> tuple[int, int]:
    """(parameters, peak bytes of the step's tensors above those alive before it)."""
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": ROWS // 2, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET,
                              "allgather_bucket_size": BUCKET},
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    x, y = torch.randn(ROWS, 2), torch.randn(ROWS, 1)
    penalty = sam(0.05)
    sharpness = EnginePenalty(engine, penalty) if penalized else None

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
    return sum(p.numel() for p in model.parameters()), peak_memory(step, torch.device("cpu"))


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for width in WIDTHS:
        count, plain = measure(width, False)
        _, penalized = measure(width, True)
        rows.append(f"| MLP width {width} ({count / 1e6:.1f} M) | {4 * count / 1e6:.1f} MB | "
                    f"{plain / 1e6:.1f} MB | {penalized / 1e6:.1f} MB |")
    if torch.distributed.get_rank() == 0:
        print("\n".join(rows))


if __name__ == "__main__":
    main()
