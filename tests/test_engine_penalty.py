"""What :class:`gradreg.integrations.engine_penalty.EnginePenalty` refuses, in one line, when it is
built, and its step on an engine that states itself as DeepSpeed's does in one process (no
DeepSpeed needed: its backward divides by the micro-batches, as DeepSpeed's does); its steps on
DeepSpeed's engine over 2 ranks are tested in tests/test_engine_penalty_deepspeed.py (slow)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradreg import GradientError
from gradreg.integrations.engine_penalty import EnginePenalty
from gradreg.penalties import asam, param_grad_norm, r1, sam


class Engine:
    """The part of DeepSpeed's engine that EnginePenalty reads: a module, called as the engine
    is; ``backward`` of the loss divided by the ``steps`` micro-batches; the boundary after
    every ``steps``-th backward."""

    def __init__(self, stage: int, module: nn.Module | None = None, steps: int = 1) -> None:
        self.module, self.stage, self.steps = module or nn.Linear(2, 1), stage, steps
        self.backwards = 0

    def zero_optimization_stage(self) -> int:
        return self.stage

    def gradient_accumulation_steps(self) -> int:
        return self.steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.backwards + 1) % self.steps == 0

    def __call__(self, x: Tensor) -> Tensor:
        return self.module(x)

    def backward(self, loss: Tensor) -> None:
        (loss / self.steps).backward()
        self.backwards += 1


@pytest.mark.parametrize(("penalty", "match"), [
    (param_grad_norm(0.1), r"differentiates the parameters twice, which DeepSpeed ZeRO-3 "
                              r"cannot .*: use method='finite_difference'"),
    (asam(0.5), r"is adaptive .*: use sam or gr, or ZeRO-2, or FSDP2 with "
                   r"gradreg\.sharding\.penalty_step")],
    ids=["exact", "adaptive"])
def test_what_zero3_does_not_take_is_refused_naming_what_does(penalty, match: str) -> None:
    with pytest.raises(GradientError, match=match):
        EnginePenalty(Engine(3), penalty)


def test_a_penalty_at_other_points_is_refused() -> None:
    with pytest.raises(GradientError, match=r"points='parameters' .* got points='real': .*; "
                                            "train with DDP or FSDP2"):
        EnginePenalty(Engine(2), r1(10.0))


def test_zero2_takes_the_module_s_trainable_parameters() -> None:
    engine = Engine(2)
    penalty = EnginePenalty(engine, sam(0.05))
    assert list(penalty.params) == list(engine.module.parameters())


@pytest.mark.parametrize("steps", [1, 2])
def test_a_step_is_sams_of_the_whole_batch(steps: int) -> None:
    r"""``steps`` micro-batches through the engine: ``.grad`` is SAM's
    :math:`\nabla L(\theta + \rho\, \bar g / \lVert \bar g \rVert)` of the whole batch, by
    hand in float64; each call draws the random numbers of one forward (the generator moves on,
    as after the engine's own forward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    params = list(model.parameters())
    g = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    norm = torch.cat([t.flatten() for t in g]).norm()
    with torch.no_grad():
        torch._foreach_add_(params, g, alpha=0.05 / norm.item())
    expected = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    with torch.no_grad():
        torch._foreach_sub_(params, g, alpha=0.05 / norm.item())
    engine = Engine(2, model, steps)
    penalty = EnginePenalty(engine, sam(0.05))
    for xb, yb in zip(x.chunk(steps), y.chunk(steps), strict=True):
        before = torch.get_rng_state()
        penalty.backward(lambda module, xb=xb, yb=yb: F.cross_entropy(module(xb), yb), on=(xb,))
        assert torch.equal(torch.get_rng_state(), before)  # the model draws none here
    for got, want in zip((p.grad for p in params), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert penalty.last_value is not None and penalty.last_value > 0


def test_each_micro_batch_draws_its_own_random_numbers() -> None:
    """Dropout's masks: two calls on the same micro-batch draw two masks (the generator moves on
    as after one forward), and the penalty's passes replay the call's own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5), nn.Linear(64, 1))
    x = torch.randn(8, 4)
    engine = Engine(2, model)
    penalty = EnginePenalty(engine, sam(0.05))
    losses = []
    for _ in range(2):
        penalty.penalty.due()
        start = torch.get_rng_state()
        losses.append(penalty.backward(lambda module: module(x).square().mean(), on=(x,)))
        with torch.random.fork_rng():
            torch.set_rng_state(start)
            model(x)  # one forward's draws
            after_one = torch.get_rng_state()
        assert torch.equal(torch.get_rng_state(), after_one)
    assert losses[0] != losses[1]
