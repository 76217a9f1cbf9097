"""One rank of Hugging Face's Trainer on 2 gloo processes with a parameter penalty (``python -m
tests.penalties.ranks_hf OUT`` with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set): a tiny GPT-2 in
float64 (the loss by the float64 ``compute_loss_func`` of the accumulation tests), each step's
batch of 8 split into 4 rows per rank, in one micro-batch or two; saves each step's gradient
(after DDP's mean) per case of :data:`CASES`."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from gradreg.penalties import asam, gr, param_grad_norm, sam

#: case -> (penalty, gradient_accumulation_steps)
CASES = {f"{name}_{steps}": (name, steps) for name in ("sam", "asam", "gr", "gnp")
         for steps in (1, 2)}
PENALTIES = {"sam": lambda: sam(0.05), "asam": lambda: asam(0.5),
             "gr": lambda: gr(1e-4, step=1e-3), "gnp": lambda: param_grad_norm(0.05)}


def train(name: str, steps: int, batch: int, directory: str, **options
          ) -> tuple[list[list[torch.Tensor]], int]:
    """Each step's gradient of 2 steps of the penalty ``name`` over the 8 sequences of
    ``Tokens(8, ignored=3)`` in micro-batches of ``batch`` rows, ``steps`` per step, and the
    number of processes the trainer saw."""
    from gradreg.hf_trainer import PenalizedTrainer
    from tests.test_hf_accumulation import float64_loss
    from tests.test_hf_trainer import Record, Tokens, arguments, tiny_gpt2

    record = Record()
    trainer = PenalizedTrainer(
        model=tiny_gpt2(), train_dataset=Tokens(8, ignored=3), callbacks=[record],
        compute_loss_func=float64_loss, penalties={name: PENALTIES[name]()},
        args=arguments(directory, max_steps=2, gradient_accumulation_steps=steps,
                       per_device_train_batch_size=batch, **options))
    trainer.train()
    return record.grads, trainer.args.world_size


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {}
    for case, (name, steps) in CASES.items():
        with tempfile.TemporaryDirectory() as directory:
            results[case] = train(name, steps, 4 // steps, directory, ddp_backend="gloo")
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's teardown at exit hung now and then on torch 2.4
