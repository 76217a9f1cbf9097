"""TRL's trainers with ``PenaltyMixin`` on 1 or 2 gloo processes (``python -m
tests.penalties.ranks_trl OUT CASES``, comma-separated keys of :data:`CASES`, with
``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*`` set; or :func:`train` in one process), a
global batch of 8 split evenly over the processes; saves each case's result from rank 0 (each
step's gradient after DDP's mean over the ranks, the final parameters, the penalty's value).

* GRPOTrainer with ``gr``: 2 prompts, 4 completions each, the completions fixed by a
  ``rollout_func`` (the k-th of a prompt's group is k + 1 tokens long, rewarded by its length),
  so that one process and two see the same generated batch; one SGD step.
* SFTTrainer with ``sam`` or ``gr`` (finite differences, which SFT's fused head allows):
  :data:`SEQUENCES`, 8 token sequences of unequal lengths (so the ranks' shares of the
  batch's tokens differ), in one micro-batch per process or two; 2 SGD steps, SFTConfig's
  defaults otherwise (gradient checkpointing on)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gradreg.penalties import gr, sam
from tests.distributed import end_rank

PROMPTS = ["w1 w2", "w3 w4"]
GENERATIONS = 4
BATCH = 8  # the global batch: per process 8 // world
LENGTHS = (8, 5, 7, 3, 6, 8, 4, 7)
SEQUENCES = [torch.randint(0, 30, (n,), generator=torch.Generator().manual_seed(i)).tolist()
             for i, n in enumerate(LENGTHS)]

#: case -> (trainer, penalty's name, the penalty, gradient_accumulation_steps)
CASES = {"grpo_gr": ("grpo", "gr", lambda: gr(1e-3, step=1e-3), 1),
         "sft_sam": ("sft", "sam", lambda: sam(0.05), 1),
         "sft_sam_accumulated": ("sft", "sam", lambda: sam(0.05), 2),
         "sft_gr": ("sft", "gr", lambda: gr(1e-3, step=1e-2), 1)}

Result = tuple[list[list[torch.Tensor]], list[torch.Tensor], torch.Tensor | None]


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


def train(case: str, world: int, directory: str, penalized: bool = True, **options) -> Result:
    """Each step's gradient, the final parameters and the weighted penalty of ``case`` with
    ``8 // world`` samples per process (without ``penalized``: the trainer's own steps, and
    None for the penalty)."""
    import datasets
    import trl

    from gradreg.integrations.hf_trainer import PenaltyMixin
    from tests.test_hf_trainer import Record
    from tests.test_hf_trl import tiny_gpt2, tokenizer

    kind, name, penalty, steps = CASES[case]
    common = {"output_dir": directory, "per_device_train_batch_size": BATCH // world // steps,
              "gradient_accumulation_steps": steps, "learning_rate": 0.1, "optim": "sgd",
              "lr_scheduler_type": "constant", "max_grad_norm": 0.0, "report_to": [],
              "save_strategy": "no", "logging_strategy": "no", "use_cpu": True,
              "disable_tqdm": True, "dataloader_num_workers": 0, "bf16": False, **options}
    record = Record()
    mixed = {"model": tiny_gpt2(), "processing_class": tokenizer(), "callbacks": [record],
             "penalties": {name: penalty()} if penalized else {}}
    if kind == "grpo":
        args = trl.GRPOConfig(max_steps=1, num_generations=GENERATIONS,
                              max_completion_length=GENERATIONS, gradient_checkpointing=False,
                              shuffle_dataset=False, **common)
        trainer = type("GRPO", (PenaltyMixin, trl.GRPOTrainer), {})(
            args=args, train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
            rollout_func=rollout,
            reward_funcs=lambda completion_ids, **_: [float(len(c)) for c in completion_ids],
            **mixed)
    else:
        trainer = type("SFT", (PenaltyMixin, trl.SFTTrainer), {})(
            args=trl.SFTConfig(max_steps=2, **common),
            train_dataset=datasets.Dataset.from_dict({"input_ids": SEQUENCES}), **mixed)
    trainer.train()
    final = [p.detach().clone() for p in trainer.model.parameters()]
    return record.grads, final, trainer.penalty_values.get(name)


def main(out: Path, cases: list[str]) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {}
    for case in cases:
        with tempfile.TemporaryDirectory() as directory:
            results[case] = train(case, int(os.environ["WORLD_SIZE"]), directory,
                                  ddp_backend="gloo")
    if rank == 0:
        torch.save(results, out / "trl.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
    end_rank()
