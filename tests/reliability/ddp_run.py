"""The training runs of the DDP parity test; ``python ddp_run.py OUT`` is one DDP rank.

The test starts both ranks itself with ``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_PORT`` set, as
torchrun or a cluster would (Lightning then launches nothing), so one pair of processes runs every
scenario in turn on one gloo process group. Each rank loads its half of every batch
(``use_distributed_sampler=False`` and :class:`~lightning_cases.BatchSlice`), and writes its
final state, or the error of a run that is expected to fail, to ``OUT``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning_cases import (
    QUIET,
    PenaltyOnly,
    batch_noise_gan,
    classifier,
    noisy_toy,
    parameters,
    sliced_loader,
    toy,
)
from torch import Tensor
from torch.utils.data import TensorDataset

BATCH, EPOCHS = 32, 2
SCENARIOS: dict[str, tuple[Callable[[], L.LightningModule], Callable[[], TensorDataset]]] = {
    "classifier_double_backprop": (
        lambda: classifier(db={"name": "double_backprop", "weight": 1.0}),
        lambda: toy("moons", 128),
    ),
    "gan_wgan_gp_r1": (
        # R1 in chunks: its gradients, taken micro-batch by micro-batch before the backward,
        # reach DDP's gradient hooks through the one backward like any other
        lambda: batch_noise_gan(gp={"name": "wgan_gp"},
                                r1={"name": "r1", "weight": 1.0, "chunks": 3}),
        lambda: noisy_toy("8gaussians", 128),
    ),
    "penalty_only": (PenaltyOnly, lambda: toy("8gaussians", 128)),
    # a penalty of the parameter gradient: of the whole batch's (the ranks' mean), not each
    # rank's own, by finite difference (SAM) and by double backward
    "classifier_sam": (lambda: classifier(sam={"name": "sam", "weight": 0.05}),
                       lambda: toy("moons", 128)),
    "classifier_param_grad_norm": (
        lambda: classifier(gnp={"name": "param_grad_norm", "weight": 0.1}),
        lambda: toy("moons", 128),
    ),
}
# (scenario, strategy) in the order the ranks run them; the last one is expected to fail
DDP_RUNS = [
    ("classifier_double_backprop", "ddp"),
    ("classifier_sam", "ddp"),
    ("classifier_param_grad_norm", "ddp"),
    ("gan_wgan_gp_r1", "ddp_find_unused_parameters_true"),
    ("penalty_only", "ddp_find_unused_parameters_true"),
    ("penalty_only", "ddp"),
]


def train(scenario: str, strategy: str = "auto", devices: int = 1) -> dict[str, Tensor]:
    """Fit ``scenario`` for ``EPOCHS`` epochs of batches of ``BATCH`` split over ``devices``
    ranks; the final parameters and buffers."""
    build, data = SCENARIOS[scenario]
    model = build()
    trainer = L.Trainer(**QUIET, devices=devices, strategy=strategy, max_epochs=EPOCHS,
                        use_distributed_sampler=False, enable_checkpointing=False)
    trainer.fit(model, sliced_loader(data(), BATCH, trainer.global_rank, trainer.world_size))
    return parameters(model)


def result_path(out: Path, scenario: str, strategy: str, rank: int) -> Path:
    return out / f"{scenario}.{strategy}.rank{rank}.pt"


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["LOCAL_RANK"])
    for scenario, strategy in DDP_RUNS:
        try:
            result: object = train(scenario, strategy, devices=2)
        except Exception as error:  # recorded for the test to check
            result = f"{type(error).__name__}: {error}"
        torch.save(result, result_path(out, scenario, strategy, rank))
    # Every result is saved. The last run fails on purpose and leaves gloo's threads up; torch
    # 2.4 then aborted in the interpreter's teardown now and then ("terminate called without an
    # active exception", also after destroy_process_group), so the rank ends here, skipping it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
