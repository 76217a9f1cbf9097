"""Steps of the digits classifier with data.global_batch, in one process or on two gloo ranks:
``python -m tests.lightning.data.global_batch_run <devices> <out.pt> <steps> <batch_size>
<val_fraction> [<penalty> [<engine>]]``
saves the parameters of rank 0 (the preset ``penalty``, default double backprop, weight 0.1;
``engine`` ``ddp``, the default, or ``fsdp``: the backbone sharded by FSDP2;
the digits' training split is 1797 - 270 - round(val_fraction 1797) samples: 1257 with 0.15).
With 2 devices the test starts both ranks itself (``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_PORT``), as ``tests/reliability/ddp_run.py`` does, and each rank ends with ``os._exit``
once its result is saved: gloo's threads sometimes abort the interpreter's teardown
("terminate called without an active exception", measured under ``ddp_spawn`` on torch 2.13 and
2.14 after training had finished)."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

from gradreg.lightning.classifier import Classifier
from gradreg.lightning.data import DigitsDataModule
from gradreg.lightning.global_batch import GlobalBatchDDPStrategy
from gradreg.lightning.sharded import ShardedPenaltyStrategy
from gradreg.models import MLP
from gradreg.penalties import make_penalty


def main(devices: int, out: str, steps: int, batch_size: int, val_fraction: float,
         penalty: str = "double_backprop", engine: str = "ddp") -> None:
    torch.set_num_threads(1)
    L.seed_everything(0)
    model = Classifier(MLP(64, 10, hidden=[32]), {"p": make_penalty(penalty, weight=0.1)},
                       pgd_steps=0)
    data = DigitsDataModule(shape=[64], batch_size=batch_size, val_fraction=val_fraction,
                            global_batch=True)
    strategy = GlobalBatchDDPStrategy() if engine == "ddp" else ShardedPenaltyStrategy(
        modules=["backbone"], global_batch=True, process_group_backend="gloo")
    ddp = {"strategy": strategy, "devices": 2} if devices == 2 else {}
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, inference_mode=False,
                        num_sanity_val_steps=0, limit_val_batches=0,
                        use_distributed_sampler=False, **ddp)
    trainer.fit(model, datamodule=data)
    # FSDP2's shards gathered whole (a collective: on every rank)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
             for k, v in model.backbone.state_dict().items()}
    if trainer.is_global_zero:
        torch.save(state, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]),
         *sys.argv[6:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
