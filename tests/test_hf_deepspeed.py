"""Penalties under DeepSpeed ZeRO in Hugging Face's Trainer are refused in one line when the
trainer is built (DeepSpeed's own errors in the double backward were ``IndexError: list index
out of range`` under ZeRO-2 and a size mismatch under ZeRO-3), naming what takes them. One
process on the CPU (``DS_ACCELERATOR=cpu``); skipped where deepspeed is not installed."""

from __future__ import annotations

import os

import pytest
import torch

from gradreg import GradientError
from gradreg.penalties import double_backprop, sam

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def _forget_deepspeed():
    """accelerate's state, transformers' DeepSpeed config, the environment and the process group
    DeepSpeed started are process-wide: later tests must inherit none of them."""
    environment = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environment)
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    if torch.distributed.is_initialized():  # DeepSpeed's, of this one process
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("penalty", [lambda: double_backprop(0.01), lambda: sam(0.05)],
                         ids=["inputs", "parameters"])
def test_deepspeed_zero_refuses_penalties_before_training(tmp_path, monkeypatch, stage: int,
                                                          penalty) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from gradreg.hf_trainer import PenalizedTrainer
    from tests.distributed import free_port
    from tests.test_hf_trainer import Tokens, arguments, tiny_llama

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                       "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(GradientError, match="not taken under DeepSpeed ZeRO yet: train with "
                                            "DDP .* or FSDP2"):
        PenalizedTrainer(model=tiny_llama(), train_dataset=Tokens(8), penalties={"p": penalty()},
                         args=arguments(tmp_path, max_steps=1, deepspeed=config))
