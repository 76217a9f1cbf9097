"""Parameter penalties in Hugging Face's Trainer on 2 processes (gloo) under DDP and FSDP2
(accelerate's FSDP2 wrapping, set on CPUs as on GPUs: ``ranks_hf._on_cpus``): each step's
gradient, after the engine's mean over the ranks, equals one process's that takes the whole
batch of 8, for sam, asam, gr, the exact param_grad_norm and double backprop at the
embeddings, with each rank's 4 rows in one micro-batch or in two (float64 throughout: a tiny
GPT-2 and a float64 ``compute_loss_func``); under FSDP2 sam and gr on each rank's shards.
Slow: two processes that each import transformers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.distributed import run_processes, run_ranks
from tests.penalties.ranks_hf import CASES, ENGINES, train

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    return run_ranks("tests.penalties.ranks_hf", out, ",".join(ENGINES), ",".join(CASES),
                     timeout=600)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("engine", ENGINES)
def test_two_ranks_step_as_one_process_with_the_whole_batch(tmp_path, ranks: list[dict],
                                                            engine: str, case: str) -> None:
    name, steps = CASES[case]
    (first, world, shards), (second, *_) = (ranks[0][f"{engine}_{case}"],
                                            ranks[1][f"{engine}_{case}"])
    whole, one, _ = train(name, steps, 8 // steps, str(tmp_path))
    assert (world, one) == (2, 1)
    # FSDP2's finite differences of the 2-norm run on each rank's shards (ShardedStep)
    assert shards is (engine == "fsdp2" and name in ("sam", "gr"))
    for got, other, want in zip(first, second, whole, strict=True):  # each of the 2 steps
        largest = max(t.abs().max() for t in want)
        for a, b, w in zip(got, other, want, strict=True):
            assert torch.equal(a, b)  # the replicas stay the same
            torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10 * largest)


def test_each_ranks_own_penalty_would_be_another_step(tmp_path, ranks: list[dict]) -> None:
    """The penalty of one rank's 4 rows alone (what each rank would penalize without the
    whole batch's gradient) moves the step by more than 1e-4 of its largest entry."""
    from gradreg.integrations.hf_trainer import PenalizedTrainer
    from gradreg.penalties import param_grad_norm
    from tests.test_hf_accumulation import float64_loss
    from tests.test_hf_trainer import Record, Tokens, arguments, tiny_gpt2

    def first_step(data) -> list[torch.Tensor]:
        record = Record()
        PenalizedTrainer(model=tiny_gpt2(), train_dataset=data, callbacks=[record],
                         compute_loss_func=float64_loss,
                         penalties={"gnp": param_grad_norm(0.05)},
                         args=arguments(str(tmp_path), max_steps=1,
                                        per_device_train_batch_size=4)).train()
        return record.grads[0]

    whole = ranks[0]["ddp_gnp_1"][0][0]
    data = Tokens(8, ignored=3)
    halves = []
    for rows in (slice(0, 4), slice(4, 8)):
        part = Tokens(4)
        part.ids, part.labels = data.ids[rows], data.labels[rows]
        halves.append(first_step(part))
    mean = [(a + b) / 2 for a, b in zip(*halves, strict=True)]
    largest = max(t.abs().max() for t in whole)
    assert max((a - b).abs().max() for a, b in zip(mean, whole, strict=True)) > 1e-4 * largest


def test_a_rank_whose_penalty_is_not_due_is_refused_on_each_not_left_waiting(tmp_path) -> None:
    """``sam(0.05, every=2)`` due on rank 0 at the first step and not on rank 1 (its counter
    one ``due()`` ahead): both ranks raise the same one-line error naming each rank's decision,
    before any collective of the penalty (which would mismatch DDP's: a hang)."""
    run_processes([sys.executable, "-m", "tests.penalties.ranks_skip", str(tmp_path), "trainer"],
                  [{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                    "LOCAL_WORLD_SIZE": "2"} for rank in (0, 1)], cwd=ROOT, timeout=300)
    first, second = ((tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1))
    assert first == second
    assert first.startswith("PenalizedTrainer on 2 processes: the ranks disagree (penalty "
                            "'sam' due: rank 0 1, rank 1 0)")
    assert "\n" not in first
