""":class:`gradreg.integrations.engine_penalty.EnginePenalty` under DeepSpeed ZeRO-3 on 2 CPU
processes (``DS_ACCELERATOR=cpu``, gloo), its finite differences on each rank's partitions
(:class:`gradreg.integrations.zero_sharded.ShardedStep`): a float32 MLP with dropout, each rank
half of a batch of 16 in two micro-batches, two SGD steps of ``sam``, ``gr`` and the
finite-difference ``param_grad_norm``, with every parameter partitioned or all kept gathered
(ZeRO-3's persistence threshold), with gradient clipping, and of the last layer alone, end at
the parameters of one process that takes the whole batch with ``accumulated_backward`` (its
dropout masks seeded as on the ranks; clipped as DeepSpeed clips), the penalty's value the
whole batch's, and each step puts the partitions back bitwise. Slow: DeepSpeed's engine on two
processes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from tests.distributed import run_ranks
from tests.penalties.ranks_zero_sharded import CASES, reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("zero_sharded")
    return run_ranks("tests.penalties.ranks_zero_sharded", out, DS_ACCELERATOR="cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_step_on_their_partitions_as_one_process_with_the_whole_batch(
        ranks: list[dict], case: str) -> None:
    (first, value, restored), (second, _, also_restored) = ranks[0][case], ranks[1][case]
    assert restored and also_restored  # the partitions put back bitwise after the second pass
    want, want_value = reference(case)
    assert torch.equal(first, second)  # the replicas stay the same
    torch.testing.assert_close(first, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(value, want_value, rtol=1e-6, atol=0)
    plain, _ = reference(case, penalized=False)
    assert (want - plain).abs().max() > 5e-5  # the penalty moves the steps (clipped: 1.1e-4)
