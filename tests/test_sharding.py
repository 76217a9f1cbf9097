"""gradreg.sharding in one process: nothing to do on an unsharded module, a module sharded over
one rank, and the clear error of a torch without public FSDP2. The 2-rank tests are in
tests/reliability/test_fsdp.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradreg import GradientError, sharding
from gradreg.penalties import as_points, param_grad_norm, r1
from gradreg.penalties.methods.param_gradient import LossAt
from tests.one_rank_fsdp import one_rank, shard


def critic() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def r1_grads(model: nn.Module, step: bool, penalty: nn.Module | None = None
             ) -> list[torch.Tensor]:
    """The gradients of mean D(x) + R1 (the penalty checks its graph itself)."""
    x = as_points(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
    with sharding.penalty_step(model) if step else torch.enable_grad():
        outputs = model(x)
        (outputs.mean() + (penalty or r1(1.0))(outputs, x)).backward()
    return [p.grad for p in model.parameters()]


def test_an_unsharded_module_steps_as_without_the_step() -> None:
    model = critic()
    assert not sharding.is_sharded(model) and sharding.sharded_modules(model) == []
    with_step, without = r1_grads(critic(), step=True), r1_grads(critic(), step=False)
    for a, b in zip(with_step, without, strict=True):
        assert torch.equal(a, b)


def test_torch_without_public_fsdp2_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    assert not sharding.supports_exact_step()
    with pytest.raises(GradientError, match=r"need torch >= 2\.6.*method='finite_difference'"):
        sharding._check_layout([])


@pytest.mark.skipif(not sharding.supports_exact_step(), reason="FSDP2 is public from torch 2.6")
def test_a_module_sharded_over_one_rank_steps_as_the_unsharded_one() -> None:
    """One rank: FSDP's reduction divides by 1, so the step's gradients are the unsharded
    module's, bit for bit; outside the step the penalty's graph is refused."""
    expected = r1_grads(critic(), step=False)
    with one_rank() as mesh:
        model = shard(critic(), mesh)
        assert sharding.is_sharded(model) and len(sharding.sharded_modules(model)) == 3
        with pytest.raises(GradientError, match="outside gradreg.sharding.penalty_step"):
            r1_grads(model, step=False)
        model.zero_grad()
        penalty = r1(1.0)
        grads = [g.full_tensor() for g in r1_grads(model, step=True, penalty=penalty)]
        model.zero_grad()
        with pytest.raises(GradientError, match="outside gradreg.sharding.penalty_step"):
            r1_grads(model, step=False, penalty=penalty)  # checked on every call
    for got, want in zip(grads, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(sharding.supports_exact_step(), reason="this torch runs the exact step")
def test_a_module_sharded_by_an_older_torchs_fsdp2_is_refused_before_the_step() -> None:
    with one_rank() as mesh:
        model = shard(critic(), mesh)
        assert sharding.is_sharded(model)
        with pytest.raises(GradientError, match=r"need torch >= 2\.6.*method='finite_difference'"):
            r1_grads(model, step=True)


def gnp_grads(model: nn.Module, step: bool) -> list[torch.Tensor]:
    """The gradients of a classifier's task loss + param_grad_norm by finite difference (the
    GNP form: the Hessian-vector product from the gradient at shifted parameters)."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    y = torch.randn(6, 1, generator=torch.Generator().manual_seed(1))
    penalty = param_grad_norm(0.1, method="finite_difference", step=1e-3)

    def task() -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    with sharding.penalty_step(model) if step else torch.enable_grad():
        loss = task()
        (loss + penalty(LossAt(task, loss), list(model.parameters()))).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.skipif(not sharding.supports_exact_step(), reason="FSDP2 is public from torch 2.6")
def test_the_gnp_form_on_a_module_sharded_over_one_rank_is_the_unsharded_ones() -> None:
    """param_grad_norm by finite difference shifts and differentiates the unsharded parameters
    that penalty_step holds (one rank: the reduction divides by 1, so the step's gradients are
    the unsharded module's); outside the step it names penalty_step."""
    expected = gnp_grads(critic(), step=False)
    with one_rank() as mesh:
        model = shard(critic(), mesh)
        with pytest.raises(GradientError, match="inside `with gradreg.sharding.penalty_step"):
            gnp_grads(model, step=False)
        model.zero_grad()
        parameters = [p.detach().full_tensor().clone() for p in model.parameters()]
        grads = [g.full_tensor() for g in gnp_grads(model, step=True)]
        assert all(torch.equal(p.detach().full_tensor(), q)  # restored after the shift
                   for p, q in zip(model.parameters(), parameters, strict=True))
    for got, want in zip(grads, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(not sharding.supports_exact_step(), reason="FSDP2 is public from torch 2.6")
def test_gathered_parameters_are_the_unsharded_ones_inside_the_step() -> None:
    """Inside the step, before any forward: the full parameters, equal to the unsharded
    module's; outside it, refused in one line; an unsharded module's own parameters."""
    plain = critic()
    assert sharding.gathered_parameters(plain) == tuple(plain.parameters())
    with one_rank() as mesh:
        model = shard(critic(), mesh)
        with pytest.raises(GradientError, match="inside gradreg.sharding.penalty_step"):
            sharding.gathered_parameters(model)
        with sharding.penalty_step(model):
            gathered = sharding.gathered_parameters(model)
            for got, want in zip(gathered, plain.parameters(), strict=True):
                assert type(got) is nn.Parameter and torch.equal(got, want)
            model(torch.zeros(1, 4)).sum().backward()  # the step reduces a gradient
