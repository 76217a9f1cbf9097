"""FSDP2 parity: every preset on a ``fully_shard`` critic over 2 ranks (gloo, CPU) inside
:func:`gradreg.sharding.penalty_step` gives the parameter gradients of the unsharded critic in
one process (``fsdp_cases.reference``), for FSDP2's default layout and for
``reshard_after_forward=False``; finite differences also without the step.

Measured on torch 2.13 and 2.14 (CPU), alike: bitwise equal (difference 0) for every preset but
``param_grad_norm`` (6e-8 in float32, 1e-16 in float64: a norm over all parameters, summed in
another order), and for bf16 parameters with float32 reduction against the unsharded critic in
bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from ddp_run import SCENARIOS, train
from fsdp_cases import CASES, LAYOUTS, Case, critic, reference, reference_training
from fsdp_lightning_run import RUNS
from lightning_cases import max_difference as max_difference_of_states
from lightning_cases import parameters

from gradreg.sharding import supports_exact_step
from tests.distributed import run_processes

# slow: the module's gloo processes, started once for its tests (~50 s)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not supports_exact_step(),
                                 reason="fully_shard is public from torch 2.6")]
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}
FIRST_ORDER_CASES = [c for c in CASES if c.first_order]
APPROXIMATE = "method='finite_difference'"


def run_ranks(script: str, out: Path) -> None:
    """Start 2 ranks of ``script`` (next to this file) writing into ``out``; wait for both."""
    run_processes([sys.executable, str(Path(__file__).with_name(script)), str(out)],
                  [{"WORLD_SIZE": "2", "NODE_RANK": "0", "RANK": str(rank), "LOCAL_RANK": str(rank)}
                   for rank in (0, 1)])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Every case on 2 ranks; case name -> full gradients, or the error's text."""
    out = tmp_path_factory.mktemp("fsdp")
    run_ranks("fsdp_run.py", out)
    return torch.load(out / "fsdp.pt", weights_only=False)


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The DDP test's Lightning scenarios under ShardedPenaltyStrategy on 2 ranks."""
    out = tmp_path_factory.mktemp("fsdp_lightning")
    run_ranks("fsdp_lightning_run.py", out)
    return out


def grads_of(results: dict[str, object], name: str) -> list[torch.Tensor]:
    grads = results[name]
    assert not isinstance(grads, str), grads  # a string is the error of the run
    assert all(g is not None for g in grads), f"{name}: a parameter has no gradient"
    return grads


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sharded_step_gives_the_gradients_of_one_process(sharded: dict, case: Case) -> None:
    expected = reference(case)
    assert max(g.abs().max().item() for g in expected) > 0.1  # a gradient worth comparing
    assert max_difference(grads_of(sharded, case.name), expected) <= TOLERANCE[case.dtype]


@pytest.mark.parametrize("case", FIRST_ORDER_CASES, ids=lambda c: c.name)
def test_finite_differences_and_perturbations_need_no_step(sharded: dict, case: Case) -> None:
    assert max_difference(grads_of(sharded, "plain:" + case.name),
                          reference(case)) <= TOLERANCE[case.dtype]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_training_ends_with_the_parameters_of_one_process(sharded: dict,
                                                                  layout: str) -> None:
    expected = reference_training(Case("wgan_gp", layout=layout))
    assert max_difference(expected, [p.detach() for p in critic(torch.float32).parameters()]) > 0.01
    assert max_difference(grads_of(sharded, f"train:{layout}"), expected) <= 1e-6


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_step_gives_the_module_its_settings_and_shards_back(sharded: dict,
                                                                layout: str) -> None:
    assert sharded[f"restored:{layout}"] == (True, True)


def test_fsdp2_alone_fails_loudly_by_default(sharded: dict) -> None:
    error = sharded["raw:default"]
    assert isinstance(error, str) and "setStorage" in error and "storage of size 0" in error


def test_fsdp2_alone_loses_the_update_when_parameters_stay_gathered(sharded: dict) -> None:
    # the failure penalty_step exists for: no error, and no gradient at all
    assert sharded["raw:no_reshard_after_forward"] == [None] * 6


@pytest.mark.parametrize("layout", ["default", "no_reshard_after_forward"])
def test_a_preset_without_the_step_is_refused_before_it_differentiates(sharded: dict,
                                                                       layout: str) -> None:
    """Neither of the two failures above reaches a gradreg penalty: it checks its graph."""
    error = sharded[f"preset:{layout}"]
    assert isinstance(error, str) and error.startswith("GradientError")
    assert "outside gradreg.sharding.penalty_step" in error and APPROXIMATE in error


def test_a_penalty_graph_through_a_sharded_module_is_refused_outside_the_step(
    sharded: dict,
) -> None:
    error = sharded["graph_outside"]
    assert isinstance(error, str) and error.startswith("GradientError")
    assert "outside gradreg.sharding.penalty_step" in error and APPROXIMATE in error
    assert sharded["graph_inside"] == "passed"


def test_a_backward_outside_the_step_is_refused(sharded: dict) -> None:
    error = sharded["backward_outside"]
    assert isinstance(error, str) and error.startswith("GradientError")
    assert "call backward() inside the `with` block" in error


def test_a_nested_step_is_refused(sharded: dict) -> None:
    assert sharded["nested"] == ("GradientError: penalty_step is already active on this "
                                 "module: do not nest it.")


def test_hybrid_sharding_is_refused_before_the_step_naming_finite_differences(
    sharded: dict,
) -> None:
    error = sharded["hsdp"]
    assert isinstance(error, str) and "2-D mesh (hybrid sharding)" in error
    assert APPROXIMATE in error


@pytest.mark.parametrize("scenario", RUNS)
def test_sharded_lightning_strategy_ends_with_the_parameters_of_one_process(
    lightning_runs: Path, scenario: str
) -> None:
    """The critic and generator (GAN) or backbone (classifier) sharded over 2 ranks, each with
    half of every batch, end where one process with the whole batch ends; measured in float32
    3.0e-8 (classifier, GAN) and 1.5e-8 (a critic trained on R1 alone, whose output bias gets no
    gradient), as DDP; the classifier's ``sam`` and exact ``param_grad_norm`` are the whole
    batch's (each rank's own penalty ends about 1e-3 away)."""
    sharded_run = torch.load(lightning_runs / f"{scenario}.pt", weights_only=False)
    assert not isinstance(sharded_run, str), sharded_run
    one_process = train(scenario)
    assert max_difference_of_states(sharded_run, one_process) <= 2e-7
    initial = parameters(SCENARIOS[scenario][0]())
    assert max_difference_of_states(one_process, initial) > 1e-3  # it did train


def test_every_layout_and_dtype_is_covered() -> None:
    exact = {(c.preset, c.dtype, c.layout) for c in CASES if not c.options and not c.mixed}
    assert {layout for _, _, layout in exact} == set(LAYOUTS)
    assert {dtype for _, dtype, _ in exact} == set(TOLERANCE)
