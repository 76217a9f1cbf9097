"""One rank of Hugging Face's Trainer under DeepSpeed ZeRO on 2 CPU processes (``python -m
tests.penalties.ranks_deepspeed OUT 2=CASE,CASE/3=CASE``, ZeRO stages and their keys of
:data:`CASES`, with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set; ``DS_ACCELERATOR=cpu``): a tiny
GPT-2 in float32, 2 SGD steps of a batch of 8 split into 4 rows per rank, in one micro-batch or
two; saves the parameters after the steps per stage and case (and whether ZeRO-3's penalty ran
on the ranks' partitions), or the one-line error the trainer raised."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from gradreg import GradientError
from gradreg.penalties import asam, double_backprop, gr, param_grad_norm, sam
from tests.distributed import end_rank

#: case -> (penalty, gradient_accumulation_steps)
CASES = {f"{name}_{steps}": (name, steps) for name in ("sam", "asam", "gr", "gnp_fd", "gnp",
                                                       "db", "none")
         for steps in (1, 2)}
PENALTIES = {"sam": lambda: sam(0.05), "asam": lambda: asam(0.5),
             "gr": lambda: gr(1e-2, step=1e-2), "gnp": lambda: param_grad_norm(0.05),
             "gnp_fd": lambda: param_grad_norm(0.05, method="finite_difference"),
             "db": lambda: double_backprop(0.1)}


def zero(stage: int) -> dict:
    """A DeepSpeed configuration of ZeRO ``stage`` with SGD (lr 0.1) in float32, clipping as
    the trainer's ``max_grad_norm`` (0: none; accelerate would set 1.0 where the key is
    missing)."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def trained(name: str, steps: int, batch: int, directory: str, **options):
    """The trainer after 2 steps of the penalty ``name`` over the 8 sequences of
    ``Tokens(8, ignored=3)`` in micro-batches of ``batch`` rows, ``steps`` per step."""
    from gradreg.integrations.hf_trainer import PenalizedTrainer
    from tests.test_hf_trainer import Tokens, arguments, tiny_gpt2

    trainer = PenalizedTrainer(
        model=tiny_gpt2().float(), train_dataset=Tokens(8, ignored=3),
        penalties={} if name == "none" else {name: PENALTIES[name]()},
        args=arguments(directory, max_steps=2, gradient_accumulation_steps=steps,
                       per_device_train_batch_size=batch, **options))
    trainer.train()
    return trainer


def train(name: str, steps: int, batch: int, directory: str, **options) -> list[torch.Tensor]:
    """The parameters after :func:`trained`'s steps."""
    trainer = trained(name, steps, batch, directory, **options)
    return [p.detach().clone() for p in trainer.model.parameters()]


def main(out: Path, plan: dict[str, list[str]]) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results: dict[str, object] = {}
    for stage, cases in plan.items():
        for case in cases:
            name, steps = CASES[case]
            with tempfile.TemporaryDirectory() as directory:
                try:
                    trainer = trained(name, steps, 4 // steps, directory,
                                      deepspeed=zero(int(stage)))
                    results[f"zero{stage}_{case}"] = [p.detach().clone()
                                                      for p in trainer.model.parameters()]
                    results[f"zero{stage}_{case}_partitions"] = trainer._partitioned is not None
                except GradientError as error:
                    results[f"zero{stage}_{case}"] = str(error)
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), {stage: cases.split(",") for stage, cases in
                             (part.split("=") for part in sys.argv[2].split("/"))})
    end_rank()
