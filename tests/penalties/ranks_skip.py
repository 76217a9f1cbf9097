"""One rank of 2 gloo ranks that disagree about a parameter penalty (``python -m
tests.penalties.ranks_skip OUT CASE`` with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set); each rank
writes the one-line error it raised (or ``"no error"``) to ``OUT/rankR.txt``. Cases:

* ``accumulated``: ``accumulated_backward(..., over_ranks=True)`` on both ranks, rank 1 with
  its last layer's parameters left out (different gradients to all-reduce);
* ``trainer``: Hugging Face's Trainer on DDP with ``sam(0.05, every=2)``, rank 1's penalty one
  ``due()`` ahead: due on rank 0 at the first step and not on rank 1 (needs transformers)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradreg import GradientError
from gradreg.penalties import param_grad_norm, sam
from gradreg.penalties.accumulation import accumulated_backward
from tests.distributed import end_rank
from tests.penalties.ranks_problem import problem


def accumulated(rank: int) -> None:
    model, x, y = problem()
    params = list(model.parameters())
    rows = slice(rank * 8, rank * 8 + 8)
    accumulated_backward(param_grad_norm(0.5), [lambda: F.cross_entropy(model(x[rows]), y[rows])],
                         params if rank == 0 else params[:2], rows=[8], on=(x,), over_ranks=True)


def trainer(rank: int) -> None:
    from gradreg.integrations.hf_trainer import PenalizedTrainer
    from tests.test_hf_trainer import Tokens, arguments, tiny_gpt2

    penalty = sam(0.05, every=2)
    if rank == 1:
        penalty.due()  # its counter one step ahead of rank 0's
    with tempfile.TemporaryDirectory() as directory:
        PenalizedTrainer(model=tiny_gpt2(), train_dataset=Tokens(8), penalties={"sam": penalty},
                         args=arguments(directory, max_steps=2, per_device_train_batch_size=4,
                                        ddp_backend="gloo")).train()


def main(out: Path, case: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if case == "accumulated":
        dist.init_process_group("gloo")
    try:
        {"accumulated": accumulated, "trainer": trainer}[case](rank)
        message = "no error"
    except GradientError as error:
        message = str(error)
    (out / f"rank{rank}.txt").write_text(message)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    end_rank()
