"""Penalties under DeepSpeed ZeRO in Hugging Face's Trainer (``DS_ACCELERATOR=cpu``).

On 2 CPU processes, 2 SGD steps of a batch of 8 split 4 + 4, float32: the parameters after the
steps equal those of one process without DeepSpeed that takes the whole batch, under ZeRO-2 for
sam, gr, the exact param_grad_norm (double backward) and its finite difference, in one
micro-batch or two per rank, and under ZeRO-3 for sam (two micro-batches) and param_grad_norm's
finite difference, on each rank's partitions (measured 4e-9 to 3e-7 against steps that the
penalty moves by 1e-3 to 2e-2).
Refused in one line when the trainer is built (before, DeepSpeed's own errors in the double
backward were ``IndexError: list index out of range`` under ZeRO-2 and a size mismatch under
ZeRO-3): the penalties at the inputs under DeepSpeed; under ZeRO-3 the exact and the adaptive
parameter penalties.
Slow: DeepSpeed's engine, and two processes."""

from __future__ import annotations

import os

import pytest
import torch

from gradreg import GradientError
from gradreg.penalties import asam, double_backprop, param_grad_norm

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from tests.distributed import free_port, run_ranks
from tests.penalties.ranks_deepspeed import CASES, train, zero

pytestmark = pytest.mark.slow
#: the cases run on 2 processes per ZeRO stage (keys of CASES): accumulation, exact and finite
#: difference under ZeRO-2; finite differences, one micro-batch per step, under ZeRO-3
TWO_RANKS = {2: ("sam_2", "gr_2", "gnp_1", "gnp_fd_2"), 3: ("sam_2", "gnp_fd_1")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("deepspeed")
    plan = "/".join(f"{stage}={','.join(cases)}" for stage, cases in TWO_RANKS.items())
    return run_ranks("tests.penalties.ranks_deepspeed", out, plan, timeout=600,
                     DS_ACCELERATOR="cpu")


@pytest.mark.parametrize(("stage", "case"), [(stage, case) for stage, cases in
                                              TWO_RANKS.items() for case in cases])
def test_zero_on_two_ranks_steps_as_one_process_with_the_whole_batch(
        tmp_path, ranks: list[dict], stage: int, case: str) -> None:
    first, second = ranks[0][f"zero{stage}_{case}"], ranks[1][f"zero{stage}_{case}"]
    name, _ = CASES[case]
    want = train(name, 1, 8, str(tmp_path))
    plain = train("none", 1, 8, str(tmp_path))
    moved = max((w - p).abs().max() for w, p in zip(want, plain, strict=True))
    assert moved > 1e-3  # the penalty moves the parameters
    # ZeRO-3's finite differences run on each rank's partitions (ShardedStep)
    assert ranks[0][f"zero{stage}_{case}_partitions"] is (stage == 3)
    for a, b, w in zip(first, second, want, strict=True):
        assert torch.equal(a, b)  # the replicas stay the same
        torch.testing.assert_close(a, w, rtol=0, atol=1e-6)


@pytest.fixture
def one_process(monkeypatch) -> None:
    """DeepSpeed on one CPU process; accelerate's state, transformers' DeepSpeed config and the
    process group DeepSpeed starts are process-wide (and the environment, where accelerate and
    DeepSpeed write too): later tests inherit none of them."""
    environment = dict(os.environ)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                       "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    yield
    os.environ.clear()
    os.environ.update(environment)
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    if torch.distributed.is_initialized():  # DeepSpeed's, of this one process
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(("stage", "penalty", "steps", "message"), [
    (2, lambda: double_backprop(0.01), 1, r"penalty 'p' \(points='inputs'\) differentiates the "
     r"trainer's forward twice, .*: train with DDP .* or FSDP2 .*; or use a parameter penalty "
     r"\(sam, asam, gr, param_grad_norm\), which DeepSpeed ZeRO-2 takes\.$"),
    (3, lambda: double_backprop(0.01), 1, r"\(sam, gr by finite difference\), which DeepSpeed "
     r"ZeRO-3 takes\.$"),
    (3, lambda: param_grad_norm(0.05), 1, r"differentiates the parameters twice, which "
     r"DeepSpeed ZeRO-3 cannot .*: use method='finite_difference'"),
    (3, lambda: asam(0.5), 1, r"penalty 'p' is adaptive .*: use sam or gr, or ZeRO-2, or FSDP2")],
    ids=["zero2-inputs", "zero3-inputs", "zero3-exact", "zero3-adaptive"])
def test_what_deepspeed_does_not_take_is_refused_before_training(
        tmp_path, one_process, stage: int, penalty, steps: int, message: str) -> None:
    from gradreg.integrations.hf_trainer import PenalizedTrainer
    from tests.test_hf_trainer import Tokens, arguments, tiny_llama

    with pytest.raises(GradientError, match=message) as refused:
        PenalizedTrainer(model=tiny_llama().float(), train_dataset=Tokens(8),
                         penalties={"p": penalty()},
                         args=arguments(tmp_path, max_steps=1, gradient_accumulation_steps=steps,
                                        per_device_train_batch_size=4, deepspeed=zero(stage)))
    assert "\n" not in str(refused.value)

