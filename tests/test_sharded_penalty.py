""":class:`gradreg.sharding.ShardedPenalty` in this process: what it refuses, in one line naming
the fix (:func:`gradreg.sharding.penalty_step` takes the exact method, ASAM, other norms and
other points), and on an FSDP2 module of one rank and on a module not sharded, the step's
gradient of one process, which :func:`~gradreg.penalties.accumulated_backward` computes, the
parameters put back bitwise (the 2-rank tests are in tests/test_fsdp_sharded_penalty.py)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradreg.autograd import GradientError
from gradreg.penalties import accumulated_backward, asam, gr, param_grad_norm, r1, sam
from gradreg.sharding import ShardedPenalty, supports_exact_step


@pytest.mark.parametrize(("penalty", "named"), [
    (param_grad_norm(0.5), "method='double_backward' differentiates the parameters twice"),
    (asam(0.5), "ASAM's shift"),
    (param_grad_norm(0.5, method="finite_difference", p=1), "p=1"),
    (r1(1.0), "points='real'")], ids=["exact", "asam", "p=1", "r1"])
def test_what_needs_the_parameters_whole_is_refused_naming_penalty_step(penalty, named) -> None:
    with pytest.raises(GradientError, match=named) as refused:
        ShardedPenalty(nn.Linear(2, 1), penalty)
    assert "gradreg.sharding.penalty_step takes it" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_module_fully_shard_did_not_shard_is_refused_on_several_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *_: 2)
    with pytest.raises(GradientError, match="Linear is not sharded, on 2 ranks: shard it, or "
                                            "under DDP use gradreg.penalties"
                                            ".accumulated_backward\\(..., over_ranks=True\\)"):
        ShardedPenalty(nn.Linear(2, 1), sam(0.05))


def test_no_micro_batches_is_refused() -> None:
    with pytest.raises(GradientError, match="micro_batches=0; it must be >= 1"):
        ShardedPenalty(nn.Linear(2, 1), sam(0.05), micro_batches=0)


def problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Dropout(0.25), nn.Linear(8, 2)).double()
    return model, torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))


@pytest.mark.parametrize("sharded", [
    pytest.param(True, marks=pytest.mark.skipif(not supports_exact_step(),
                                                reason="fully_shard is public from torch 2.6")),
    False], ids=["fsdp2_one_rank", "unsharded"])
@pytest.mark.parametrize("make", [lambda: sam(0.05), lambda: gr(0.5, step=1e-3)],
                         ids=["sam", "gr"])
def test_one_process_gives_the_gradient_of_accumulated_backward(make, sharded: bool) -> None:
    from tests.one_rank_fsdp import one_rank, shard

    model, x, y = problem()
    penalty = make()
    penalty.due()
    parts = [lambda rows=rows: F.cross_entropy(model(x[rows]), y[rows])
             for rows in (slice(0, 4), slice(4, 8))]
    states = []
    for k in range(2):
        torch.manual_seed(7 + k)
        states.append(torch.get_rng_state())

    def seeded(k: int) -> torch.Tensor:
        torch.set_rng_state(states[k])
        return parts[k]()

    _, want_value = accumulated_backward(penalty, [lambda k=k: seeded(k) for k in range(2)],
                                         list(model.parameters()), rows=[4, 4], on=(x,))
    want = [p.grad.clone() for p in model.parameters()]
    other, _, _ = problem()
    before = [p.detach().clone() for p in other.parameters()]
    with one_rank() if sharded else nullcontext() as mesh:
        other = shard(other, mesh) if sharded else other
        sharpness = ShardedPenalty(other, make(), micro_batches=2)
        sharpness.penalty.due()
        for k, rows in enumerate((slice(0, 4), slice(4, 8))):
            torch.set_rng_state(states[k])
            sharpness.backward(lambda module, rows=rows: F.cross_entropy(module(x[rows]),
                                                                         y[rows]), on=(x,))
        got = [p.grad.full_tensor() if sharded else p.grad for p in other.parameters()]
        after = [p.detach().full_tensor() if sharded else p.detach()
                 for p in other.parameters()]
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))  # put back
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-13)
    torch.testing.assert_close(sharpness.last_value, want_value, rtol=1e-13, atol=0)


class Partly(nn.Module):
    """``body``, and a layer its forward does not use."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.unused = body, nn.Linear(2, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.skipif(not supports_exact_step(), reason="fully_shard is public from torch 2.6")
def test_a_penalized_parameter_the_loss_does_not_reach_is_refused() -> None:
    from tests.one_rank_fsdp import one_rank, shard

    body, x, y = problem()
    model = Partly(body)
    with one_rank() as mesh:
        model = shard(model, mesh)
        sharpness = ShardedPenalty(model, sam(0.05))
        sharpness.penalty.due()
        with pytest.raises(GradientError, match=r"the penalized parameters \[4, 5\] got no "
                                                "gradient in the step's backward: pass params="):
            sharpness.backward(lambda module: F.cross_entropy(module(x), y), on=(x,))
