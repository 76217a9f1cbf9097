"""The Lightning side of the FSDP2 parity test; ``python fsdp_lightning_run.py OUT`` is one
rank of :class:`~gradreg.lightning.sharded.ShardedPenaltyStrategy` on 2 CPU processes (gloo).

The scenarios and data are those of the DDP parity test (``ddp_run.py``): each rank loads its
half of every batch. Rank 0 writes each scenario's final parameters and buffers, gathered from
the shards, or the error of the run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from ddp_run import BATCH, EPOCHS, SCENARIOS
from lightning_cases import QUIET, sliced_loader
from torch import Tensor

from gradreg.lightning.sharded import ShardedPenaltyStrategy

RUNS = ("classifier_double_backprop", "gan_wgan_gp_r1", "penalty_only", "classifier_sam",
        "classifier_param_grad_norm")


def train_sharded(scenario: str) -> dict[str, Tensor]:
    build, data = SCENARIOS[scenario]
    model = build()
    trainer = L.Trainer(**QUIET, devices=2, strategy=ShardedPenaltyStrategy(),
                        max_epochs=EPOCHS, use_distributed_sampler=False,
                        enable_checkpointing=False)
    trainer.fit(model, sliced_loader(data(), BATCH, trainer.global_rank, trainer.world_size))
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items() if isinstance(v, Tensor)}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    for scenario in RUNS:
        try:
            result: object = train_sharded(scenario)
        except Exception as error:  # recorded for the test to check
            result = f"{type(error).__name__}: {error}"
        if int(os.environ["LOCAL_RANK"]) == 0:
            torch.save(result, out / f"{scenario}.pt")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown with gloo's threads up (see ddp_run.py)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
