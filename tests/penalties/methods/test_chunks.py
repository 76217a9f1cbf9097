"""``chunks``: the penalty built and differentiated one micro-batch at a time is the exact penalty
(value and every gradient, parameters and the generator upstream of the points), with less peak
memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.profiler import ProfilerActivity, profile

from gradreg import GradientError, regularized_backward
from gradreg.penalties import GradientPenalty, make_penalty, methods

BATCH = 12


def critic() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8), nn.Softplus(),
                          nn.Linear(8, 1), nn.Flatten(0)).double()
    with torch.no_grad():  # input-gradient norms on both sides of 1 (WGAN-LP is one-sided)
        model[4].weight.mul_(36)
    return model


def generator() -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(3, 5).double()


def step(penalty: GradientPenalty, modules: list[nn.Module], fn: object, points: Tensor,
         fn_args: tuple[Tensor, ...] = (), loss_scale: float | None = None,
         ) -> tuple[Tensor, Tensor]:
    """The value of ``penalty(fn, points)`` and the ``.grad`` of every parameter after one
    backward of ``3 * value`` (the factor checks that the carried gradient is scaled)."""
    params = [p for m in modules for p in m.parameters()]
    for p in params:
        p.grad = None
    value = penalty(fn, points, fn_args=fn_args, loss_scale=loss_scale)
    (3 * value).backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    return value.detach(), torch.cat([g.flatten() for g in grads])


CONFIGS = [("wgan_gp", {}), ("wgan_lp", {"reduction": "sum"}), ("r1", {"p": 1.5, "power": 1.0}),
           ("derivative", {"order": 2}), ("jacobian", {"count": 1})]


@pytest.mark.parametrize(("preset", "overrides"), CONFIGS)
@pytest.mark.parametrize("chunks", [2, 5, BATCH, BATCH + 7])
def test_chunks_give_the_exact_value_and_gradients(preset: str, overrides: dict,
                                                   chunks: int) -> None:
    """Points from a generator (non-leaf): the generator's gradient must arrive too. 5 does not
    divide 12 (uneven micro-batches); more chunks than samples gives one sample each."""
    d, g = critic(), generator()
    z = torch.randn(BATCH, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    exact = step(make_penalty(preset, **overrides), [d, g], d, g(z))
    chunked = step(make_penalty(preset, chunks=chunks, **overrides), [d, g], d, g(z))
    assert exact[1][-18:].abs().max() > 0  # the generator gets a gradient through the points
    torch.testing.assert_close(chunked, exact, rtol=1e-12, atol=1e-13)


def test_chunked_double_backprop_splits_the_labels_with_the_points() -> None:
    d = critic()
    head = nn.Linear(1, 3).double()
    x = torch.randn(BATCH, 5, dtype=torch.float64).requires_grad_()
    labels = torch.arange(BATCH) % 3

    def losses(inputs: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(head(d(inputs).unsqueeze(1)), targets, reduction="none")

    exact = step(make_penalty("double_backprop"), [d, head], losses(x, labels), x)
    for chunks in (4, 5):
        chunked = step(make_penalty("double_backprop", chunks=chunks), [d, head], losses, x,
                       fn_args=(labels,))
        torch.testing.assert_close(chunked, exact, rtol=1e-12, atol=1e-13)


def test_chunked_parameter_gradient_passes_gradcheck() -> None:
    """Finite differences of the penalty w.r.t. the parameters (an oracle independent of
    autograd) against the gradient that the chunks carry into the backward."""
    d = critic()
    x = torch.randn(7, 5, dtype=torch.float64).requires_grad_()
    names = [n for n, _ in d.named_parameters()]

    def penalty_of(*params: Tensor) -> Tensor:
        weights = dict(zip(names, params, strict=True))
        return make_penalty("wgan_gp", chunks=3)(
            lambda q: functional_call(d, weights, (q,)), x)

    params = tuple(p.detach().clone().requires_grad_() for p in d.parameters())
    assert torch.autograd.gradcheck(penalty_of, params)


def test_chunks_through_regularized_backward_match_the_exact_step() -> None:
    d = critic()
    x = torch.randn(BATCH, 5, dtype=torch.float64).requires_grad_()
    params = list(d.parameters())
    results = []
    for chunks in (1, 3):
        task = d(x).mean()
        regularized_backward(task, [make_penalty("r1", chunks=chunks)(d, x)], params)
        results.append(torch.cat([p.grad.flatten() for p in params]))
        assert x.grad is None  # leaf points get no gradient, as without chunks
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=1e-13)


def peak_bytes(run: object) -> int:
    """Peak of tensor bytes allocated minus freed during ``run()`` (the allocator's events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = prof.profiler.kineto_results.events()
    current = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        current += nbytes
        peak = max(peak, current)
    return peak


def test_chunks_divide_the_peak_memory_of_the_penalty() -> None:
    torch.manual_seed(0)
    d = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                      nn.Linear(256, 1), nn.Flatten(0))
    x = torch.randn(1024, 32).requires_grad_()
    peaks = {}
    for chunks in (1, 8):
        penalty = make_penalty("wgan_gp", chunks=chunks)
        peaks[chunks] = peak_bytes(lambda p=penalty: p(d, x).backward())
    # The graph of 1024 samples x 2 layers x 256 units x several saved tensors against an
    # eighth of it plus parameter-sized buffers: measured 10.5 MB against 2.1 MB.
    assert peaks[8] < peaks[1] / 3, peaks


@pytest.mark.parametrize(
    ("options", "message"),
    [({"chunks": 0}, "chunks must be an int >= 1"),
     ({"chunks": 2.0}, "chunks must be an int >= 1"),
     ({"chunks": 2, "method": "finite_difference"}, "choose method='double_backward'"),
     ({"chunks": 2, "target": "ema"}, "an 'ema' target couples the samples"),
     ({"chunks": 2, "points": "parameters"}, "per-sample points")],
)
def test_invalid_chunks(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradientPenalty(**options)


def test_chunks_need_a_callable() -> None:
    d = critic()
    x = torch.randn(4, 5, dtype=torch.float64).requires_grad_()
    penalty = make_penalty("r1", chunks=2)
    assert penalty.needs_callable and not make_penalty("r1").needs_callable
    with pytest.raises(ValueError, match="chunks=2 need outputs as a callable"):
        penalty(d(x), x)


def test_chunks_under_a_loss_scale_give_the_unscaled_gradient() -> None:
    d = critic()
    x = torch.randn(BATCH, 5, dtype=torch.float64).requires_grad_()
    exact = step(make_penalty("r1"), [d], d, x)
    scaled = step(make_penalty("r1", chunks=3), [d], d, x, loss_scale=1024.0)
    torch.testing.assert_close(scaled, exact, rtol=1e-12, atol=1e-13)


def test_in_chunks_accumulates_expanded_gradients() -> None:
    """d/dw of (sum x^2) * sum(w) is an expanded (stride-0) view: it is copied, not added to."""
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    x = torch.arange(6.0, dtype=torch.float64).reshape(6, 1)
    value = methods.in_chunks(lambda xs, args: xs[0].square().sum() * w.sum(), (x,), 3,
                              mean=False)
    value.backward()
    assert float(value.detach()) == 3 * 55.0
    torch.testing.assert_close(w.grad, torch.full((3,), 55.0, dtype=torch.float64))


def test_chunks_of_an_empty_batch_say_so() -> None:
    with pytest.raises(GradientError, match="empty batch"):
        make_penalty("r1", chunks=4)(critic(), torch.zeros(0, 5, dtype=torch.float64,
                                                            requires_grad=True))
