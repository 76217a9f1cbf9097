""":class:`gradreg.sharding.ShardedPenalty` on FSDP2 modules over 2 CPU processes (gloo): a
parameter penalty's finite difference on each rank's shards. An MLP with dropout sharded by
``fully_shard``, each rank half of a batch of 16 in two micro-batches, two SGD steps of ``sam``,
``gr``, the finite-difference ``param_grad_norm`` and ``sam`` of the last layer alone, in float64
and float32, end at the parameters of one process that takes the whole batch with
``accumulated_backward`` (its dropout masks seeded as on the ranks), the penalty's value the
whole batch's, and each step puts the shards back bitwise. Slow: two processes."""

from __future__ import annotations

import pytest
import torch

from gradreg import sharding
from tests.distributed import run_ranks
from tests.penalties.ranks_fsdp_sharded import CASES, DTYPES
from tests.penalties.ranks_zero_sharded import reference

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sharding.supports_exact_step(),
                                 reason="fully_shard is public from torch 2.6")]
#: dtype -> tolerance against one process (float32: the two sums of ranks and micro-batches
#: differ in rounding, times gr's weight / step = 50)
TOLERANCE = {"float64": 1e-12, "float32": 1e-6}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp_sharded")
    return run_ranks("tests.penalties.ranks_fsdp_sharded", out)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_step_on_their_shards_as_one_process_with_the_whole_batch(
        ranks: list[dict], case: str, dtype: str) -> None:
    (first, value, restored), (second, other_value, also_restored) = (
        ranks[0][case, dtype], ranks[1][case, dtype])
    assert restored and also_restored  # the shards put back bitwise after the second pass
    want, want_value = reference(case, dtype=DTYPES[dtype])
    assert torch.equal(first, second)  # the ranks gather the same parameters
    atol = TOLERANCE[dtype]
    torch.testing.assert_close(first, want, rtol=0, atol=atol)
    torch.testing.assert_close(value, want_value, rtol=atol, atol=0)
    assert torch.equal(value, other_value)  # the value is the same on every rank
    plain, _ = reference(case, penalized=False, dtype=DTYPES[dtype])
    assert (want - plain).abs().max() > 5e-5  # the penalty moves the steps
