"""The penalty of a batch split over ranks (``over_ranks``): 2 gloo ranks, each with half of the
batch in two micro-batches, end with the gradient of one process that takes the whole batch in
four, for both methods (float64); without a process group the option is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gradreg import GradientError, sharding
from gradreg.penalties import param_grad_norm
from gradreg.penalties.accumulation import Accumulation
from tests.distributed import run_processes, run_ranks
from tests.penalties.ranks_problem import METHODS, OWN_STEPS, own_step, problem, step

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    return run_ranks("tests.penalties.ranks_run", out, timeout=120)


@pytest.mark.parametrize("method", METHODS)
def test_two_ranks_take_the_penalty_of_the_whole_batch(ranks: list[dict], method: str) -> None:
    first, second = ranks[0][method], ranks[1][method]
    model, x, y = problem()
    whole = step(model, x, y, method, micro_batches=4)
    assert torch.equal(first["grad"], second["grad"])  # the replicas stay the same
    # float rounding (by the finite difference: of the gradients, divided by the step 1e-5)
    assert ((first["grad"] - whole["grad"]).norm() / whole["grad"].norm()).item() < 1e-10
    torch.testing.assert_close(first["penalty"], whole["penalty"], rtol=1e-13, atol=0)
    assert torch.equal(first["penalty"], second["penalty"])
    torch.testing.assert_close((first["loss"] + second["loss"]) / 2, whole["loss"],
                               rtol=1e-14, atol=0)
    own = step(*problem()[:1], x[:8], y[:8], method, micro_batches=2)
    # each rank's own penalty, the objective without over_ranks, is another one
    assert (own["grad"] - whole["grad"]).norm() > 1e-3 * whole["grad"].norm()


@pytest.mark.parametrize("method", METHODS)
def test_unequal_shares_are_weighted_by_their_samples(ranks: list[dict], method: str) -> None:
    """5 rows on one rank (one micro-batch) and 11 on the other (4 + 7): the step of the one
    batch of 16, the same on both ranks."""
    first, second = ranks[0][f"unequal_{method}"], ranks[1][f"unequal_{method}"]
    model, x, y = problem()
    whole = step(model, x, y, method)
    assert torch.equal(first["grad"], second["grad"])
    assert ((first["grad"] - whole["grad"]).norm() / whole["grad"].norm()).item() < 1e-10
    torch.testing.assert_close(first["penalty"], whole["penalty"], rtol=1e-12, atol=0)
    torch.testing.assert_close((5 * first["loss"] + 11 * second["loss"]) / 16, whole["loss"],
                               rtol=1e-13, atol=0)


@pytest.mark.parametrize("how", OWN_STEPS)
def test_a_step_in_a_ddp_model_is_averaged_by_ddp(ranks: list[dict], how: str) -> None:
    """Each rank's own penalty (no ``over_ranks``), its gradient averaged by DDP's reducer: the
    mean of the two halves' steps taken apart, the same on both ranks (written to ``.grad``
    directly, it would not reach the reducer and the replicas would part)."""
    first, second = (r[f"ddp_{how}"] for r in ranks)
    x, y = problem()[1:]
    halves = [own_step(model, model, x[rows], y[rows], how)
              for model, rows in ((problem()[0], slice(0, 8)), (problem()[0], slice(8, 16)))]
    assert torch.equal(first, second)
    mean = (halves[0] + halves[1]) / 2
    assert ((first - mean).norm() / mean.norm()).item() < 1e-12
    assert (halves[0] - halves[1]).norm() > 1e-2 * mean.norm()  # the halves do differ


def test_over_ranks_without_a_process_group_is_refused() -> None:
    model, _, _ = problem()
    with pytest.raises(GradientError, match="over_ranks=True averages the gradient over the "
                                            "ranks .* none is initialized"):
        Accumulation(param_grad_norm(0.5, method="finite_difference"),
                     list(model.parameters()), over_ranks=True)


@pytest.fixture(scope="module")
def sharded_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fsdp_ranks")
    run_processes([sys.executable, "-m", "tests.penalties.ranks_fsdp", str(out)],
                  [{"RANK": str(rank), "WORLD_SIZE": "2"} for rank in (0, 1)], cwd=ROOT,
                  timeout=120)
    return torch.load(out / "fsdp.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.skipif(not sharding.supports_exact_step(), reason="FSDP2 is public from torch 2.6")
@pytest.mark.parametrize("method", METHODS)
def test_an_fsdp2_module_over_two_ranks_takes_the_penalty_of_the_whole_batch(
        sharded_ranks: dict, method: str) -> None:
    """Plain PyTorch: the MLP sharded by ``fully_shard`` over 2 ranks, each with half of the
    batch in two micro-batches, ``accumulated_backward(..., over_ranks=True)`` on
    ``gathered_parameters`` inside ``penalty_step``: the full gradient after FSDP's
    reduce-scatter is one process's with the whole batch in four (measured 3.6e-12 relative
    by finite difference, 1.4e-16 by double backward)."""
    model, x, y = problem()
    whole = step(model, x, y, method, micro_batches=4)["grad"]
    assert ((sharded_ranks[method] - whole).norm() / whole.norm()).item() < 1e-10


@pytest.mark.slow
def test_ranks_that_disagree_are_refused_on_each_not_left_waiting(tmp_path) -> None:
    """Rank 1 penalizes fewer parameters than rank 0: both raise the same one-line error naming
    each rank's count before the gradients' all-reduce (which would mismatch: the backend's
    abort, or a wait until its timeout); the processes end well within the test's timeout."""
    run_processes([sys.executable, "-m", "tests.penalties.ranks_skip", str(tmp_path),
                   "accumulated"], [{"RANK": str(rank), "WORLD_SIZE": "2"} for rank in (0, 1)],
                  cwd=ROOT, timeout=120)
    first, second = ((tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1))
    assert first == second
    assert first.startswith("accumulated_backward over ranks: the ranks disagree "
                            "(penalized parameters' entries: rank 0 131, rank 1 80)")
    assert "\n" not in first
