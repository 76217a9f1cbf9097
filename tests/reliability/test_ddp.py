"""DDP parity: 2 ranks (gloo, CPU), each with half of every batch, end where 1 process with the
whole batch ends.

Why it is exact: the penalties are means of per-sample terms, each sample's gradient depends on
that sample only, and DDP averages the ranks' gradients, so the mean over B/2 samples averaged
over 2 ranks is the mean over B: only the summation order differs. Measured: 3.0e-8 (classifier
with double backprop, GAN with WGAN-GP + R1 in chunks), 1.5e-8 (penalty-only critic) in fp32.

A penalty-only loss (R1 alone) gives the critic's output bias no gradient; plain ``ddp`` refuses
that, ``ddp_find_unused_parameters_true`` handles it. The GAN needs it too: each phase freezes the
other network.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from ddp_run import DDP_RUNS, SCENARIOS, result_path, train
from lightning_cases import max_difference, parameters

from tests.distributed import run_processes

# the module's two gloo processes run every scenario once, for all its tests (~28 s)
pytestmark = pytest.mark.slow
TOLERANCE = 2e-7  # fp32; the measured differences are 1.5e-8 to 3e-8
PARITY_RUNS = DDP_RUNS[:-1]


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Start 2 ranks that run every scenario of ``DDP_RUNS``; the directory of their results."""
    out = tmp_path_factory.mktemp("ddp")
    script = Path(__file__).with_name("ddp_run.py")
    run_processes([sys.executable, str(script), str(out)],
                  [{"WORLD_SIZE": "2", "NODE_RANK": "0", "LOCAL_RANK": str(rank)}
                   for rank in (0, 1)])
    return out


def load(out: Path, scenario: str, strategy: str, rank: int) -> object:
    return torch.load(result_path(out, scenario, strategy, rank), weights_only=False)


@pytest.mark.parametrize(("scenario", "strategy"), PARITY_RUNS)
def test_two_ranks_end_with_the_parameters_of_one_process(
    ddp_results: Path, scenario: str, strategy: str
) -> None:
    rank0, rank1 = (load(ddp_results, scenario, strategy, rank) for rank in (0, 1))
    assert not isinstance(rank0, str), rank0  # a string is the error of the run
    assert max_difference(rank0, rank1) == 0.0  # DDP keeps the replicas identical
    one_process = train(scenario)
    assert max_difference(rank0, one_process) <= TOLERANCE
    initial = parameters(SCENARIOS[scenario][0]())
    assert max_difference(one_process, initial) > 1e-3  # it did train


def test_plain_ddp_refuses_a_penalty_only_loss_and_names_the_fix(ddp_results: Path) -> None:
    error = load(ddp_results, "penalty_only", "ddp", 0)
    assert isinstance(error, str) and "not used in producing the loss" in error
    assert "ddp_find_unused_parameters_true" in error
