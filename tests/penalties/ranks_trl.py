"""TRL's GRPOTrainer with ``PenaltyMixin`` and ``gr`` on 1 or 2 gloo processes (``python -m
tests.penalties.ranks_grpo OUT`` with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*`` set,
or :func:`grpo_step` in one process): 2 prompts, 4 completions each, the completions fixed by a
``rollout_func`` (the k-th of a prompt's group is k + 1 tokens long, rewarded by its length),
so that one process and two see the same generated batch; one SGD step. Saves the step's
gradient (DDP's mean over the ranks) and the penalty's value from rank 0."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

PROMPTS = ["w1 w2", "w3 w4"]
GENERATIONS = 4


def rollout(prompts: list[str], trainer: Any) -> dict[str, list]:
    """The k-th occurrence of a prompt in ``prompts`` gets k + 1 tokens (k mod the group)."""
    tokenizer = trainer.processing_class
    seen: dict[str, int] = {}
    completions = []
    for prompt in prompts:
        k = seen[prompt] = seen.get(prompt, -1) + 1
        completions.append([(7 * k + 3 * j + len(prompt)) % 30 for j in range(k % GENERATIONS + 1)])
    return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts],
            "completion_ids": completions, "logprobs": None}


def grpo_step(world: int, directory: str, penalized: bool = True, **options
              ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """One step's gradient and the weighted penalty (without ``penalized``: GRPO's own step,
    and None), with ``8 // world`` samples per process."""
    import datasets
    import trl

    from gradreg.integrations.hf_trainer import PenaltyMixin
    from gradreg.penalties import gr
    from tests.test_hf_trainer import Record
    from tests.test_hf_trl import tiny_gpt2, tokenizer

    class GRPO(PenaltyMixin, trl.GRPOTrainer):
        pass

    args = trl.GRPOConfig(output_dir=directory, max_steps=1,
                          per_device_train_batch_size=8 // world, num_generations=GENERATIONS,
                          max_completion_length=GENERATIONS, learning_rate=0.1, optim="sgd",
                          max_grad_norm=0.0, report_to=[], save_strategy="no",
                          logging_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False,
                          gradient_checkpointing=False, shuffle_dataset=False, **options)
    record = Record()
    trainer = GRPO(model=tiny_gpt2(), args=args,
                   train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
                   processing_class=tokenizer(), rollout_func=rollout,
                   reward_funcs=lambda completion_ids, **_: [float(len(c))
                                                             for c in completion_ids],
                   penalties={"gr": gr(1e-3, step=1e-3)} if penalized else {},
                   callbacks=[record])
    trainer.train()
    return record.grads[0], trainer.penalty_values.get("gr")


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    with tempfile.TemporaryDirectory() as directory:
        result = grpo_step(int(os.environ["WORLD_SIZE"]), directory, ddp_backend="gloo")
    if rank == 0:
        torch.save(result, out / "grpo.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's teardown at exit hung now and then on torch 2.4
