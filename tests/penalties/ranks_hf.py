"""One rank of Hugging Face's Trainer on 2 gloo processes with a parameter penalty (``python -m
tests.penalties.ranks_hf OUT ENGINES CASES``, comma-separated keys of :data:`ENGINES` and
:data:`CASES`, with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set): a tiny GPT-2 in float64 (the
loss by the float64 ``compute_loss_func`` of the accumulation tests), each step's batch of 8
split into 4 rows per rank, in one micro-batch or two; saves each step's gradient (after the
engine's mean over the ranks; FSDP2's shards gathered) per engine and case, and whether the
penalty ran on FSDP2's shards."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from gradreg.penalties import asam, double_backprop, gr, param_grad_norm, sam
from tests.distributed import end_rank

#: case -> (penalty, gradient_accumulation_steps)
CASES = {f"{name}_{steps}": (name, steps) for name in ("sam", "asam", "gr", "gnp", "db")
         for steps in (1, 2)}
PENALTIES = {"sam": lambda: sam(0.05), "asam": lambda: asam(0.5),
             "gr": lambda: gr(1e-4, step=1e-3), "gnp": lambda: param_grad_norm(0.05),
             "db": lambda: double_backprop(0.1)}


def _on_cpus(base: type) -> type:
    """``base`` with accelerate's FSDP on CPU processes: accelerate (1.15) runs the FSDP plugin
    on GPUs only and drops it on CPUs (plain DDP then); here its state is set to FSDP after the
    accelerator is made, so that ``prepare`` shards the model with FSDP2 as on GPUs."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class OnCPUs(base):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

    return OnCPUs


def train(name: str, steps: int, batch: int, directory: str, **options
          ) -> tuple[list[list[torch.Tensor]], int, bool]:
    """Each step's gradient of 2 steps of the penalty ``name`` over the 8 sequences of
    ``Tokens(8, ignored=3)`` in micro-batches of ``batch`` rows, ``steps`` per step, the
    number of processes the trainer saw, and whether the penalty ran on FSDP2's shards."""
    from gradreg.integrations.hf_trainer import PenalizedTrainer
    from tests.test_hf_accumulation import float64_loss
    from tests.test_hf_trainer import Record, Tokens, arguments, tiny_gpt2

    OnCPUs = _on_cpus(PenalizedTrainer)

    record = Record()
    trainer = (OnCPUs if options.get("fsdp") else PenalizedTrainer)(
        model=tiny_gpt2(), train_dataset=Tokens(8, ignored=3), callbacks=[record],
        compute_loss_func=float64_loss, penalties={name: PENALTIES[name]()},
        args=arguments(directory, max_steps=2, gradient_accumulation_steps=steps,
                       per_device_train_batch_size=batch, **options))
    trainer.train()
    full = [[g.full_tensor() if hasattr(g, "full_tensor") else g for g in step]  # FSDP2's shards
            for step in record.grads]
    return full, trainer.args.world_size, trainer._partitioned is not None


#: engine -> the trainer's options for it
ENGINES = {"ddp": {"ddp_backend": "gloo"},
           "fsdp2": {"ddp_backend": "gloo", "fsdp": True,
                     "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}}}


def main(out: Path, engines: list[str], cases: list[str]) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {}
    for engine in engines:
        for case in cases:
            name, steps = CASES[case]
            with tempfile.TemporaryDirectory() as directory:
                results[f"{engine}_{case}"] = train(name, steps, 4 // steps, directory,
                                                    **ENGINES[engine])
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(","))
    end_rank()
