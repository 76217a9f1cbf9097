""":class:`gradreg.integrations.engine_penalty.EnginePenalty` on DeepSpeed's engine, ZeRO-2 on 2 CPU
processes (``DS_ACCELERATOR=cpu``), each with half of a batch of 16 in two micro-batches
(``gradient_accumulation_steps=2``), ``engine.backward``/``engine.step``: one SGD step of sam
and of the exact param_grad_norm ends at the parameters of one process that takes the whole
batch with ``accumulated_backward`` (float32; measured 1.5e-8), the penalty's value the whole
batch's; so does sam under ZeRO-3. Slow: DeepSpeed's engine on two processes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from tests.distributed import run_ranks
from tests.penalties.ranks_engine import PENALTIES, float_problem, reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("engine")
    return run_ranks("tests.penalties.ranks_engine", out, DS_ACCELERATOR="cpu")


@pytest.mark.parametrize("case", [*PENALTIES, "zero3_sam"])
def test_two_ranks_step_as_one_process_with_the_whole_batch(ranks: list[dict], case: str) -> None:
    (first, value), (second, _) = ranks[0][case], ranks[1][case]
    want, want_value = reference(case.removeprefix("zero3_"))
    assert torch.equal(first, second)  # the replicas stay the same
    torch.testing.assert_close(first, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(value, want_value, rtol=1e-6, atol=0)
    start = torch.cat([p.detach().flatten() for p in float_problem()[0].parameters()])
    plain = reference_without_penalty(start)
    assert (want - plain).abs().max() > 1e-3  # the penalty moves the step


def reference_without_penalty(start: torch.Tensor) -> torch.Tensor:
    """The parameters after one SGD step of the task loss alone on the whole batch."""
    import torch.nn.functional as F

    from tests.penalties.ranks_engine import LR

    model, x, y = float_problem()
    params = list(model.parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    return start - LR * torch.cat([g.flatten() for g in grads])
