"""The penalty step launches no more kernels than the same step written by hand.

On a GPU a fixed cost per step is kernel launches. Each step below is counted as the aten ops it
dispatches (``TorchDispatchMode``; views and detaches left out, as they launch nothing), on its
second call (the first call's checks run once), beside its hand-written twin on the same model, the
same points and the same data: WGAN-GP at interpolates of an MLP critic, R1 at the reals (forward
shared with the loss), double backprop on a classifier's per-sample losses, SAM's two passes
(``penalized_backward``), ASAM's and GR's (the same, shifted along the gradient) and StyleGAN2's
path length at W+ latents. The guards stay on: a norm whose gradient is 0 at 0, the finite check and
a running mean that a non-finite batch leaves as it was. Each step also computes its twin's
parameter gradients (float64).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradreg import NonFiniteError
from gradreg.penalties import (
    GradientPenalty,
    LossAt,
    as_points,
    asam,
    double_backprop,
    gr,
    interpolate,
    path_length,
    penalized_backward,
    r1,
    sam,
    wgan_gp,
)
from gradreg.torch_compat import TorchDispatchMode

#: Steps whose kernel count may exceed the hand-written one's by this factor at most.
LIMIT = 1.02
#: Ops over the factor for what a twin does not compute. GR's (gradientregularization_trl's
#: step) takes no value of the penalty: gradreg's value (the parameters' norms, one stack and
#: a dot: 3 ops), its weighting (1), the finite check (2) and, on the CPU, the read of the norm
#: that makes the shift's amount and factor Python numbers (1).
NOT_IN_THE_TWIN = {"gr": 7}


class _Ops(TorchDispatchMode):
    """Count the aten ops dispatched, views and detaches left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket is not torch.ops.aten.detach:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def counted(step: Callable[[], None]) -> Counter[str]:
    """The ops of the second call of ``step``."""
    step()
    with _Ops() as ops:
        step()
    return ops.ops


def critic(device: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32),
                         nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Flatten(0)).to(device, dtype)


def classifier(device: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4)).to(device, dtype)


class WPlusGenerator(nn.Module):
    """W+ latents [B, 4, 8] -> images [B, 1, 4, 4], each layer's w through its own weights."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 16) for _ in range(4))

    def forward(self, ws: Tensor) -> Tensor:
        h = self.layers[0](ws[:, 0]).tanh()
        for i in range(1, len(self.layers)):
            h = h + self.layers[i](ws[:, i]).tanh()
        return h.view(-1, 1, 4, 4)


def grad_of(out: Tensor, x: Tensor) -> Tensor:
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return g


@dataclass
class Steps:
    """A step of the library, its hand-written twin, the tensors they read (new data is copied
    into them), the model and the penalty."""

    library: Callable[[], None]
    hand: Callable[[], None]
    inputs: tuple[Tensor, ...]
    model: nn.Module
    penalty: nn.Module


def wgan_gp_steps(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Steps:
    model, gp = critic(device, dtype), wgan_gp(10.0)
    real, fake = (torch.randn(8, 16, device=device, dtype=dtype) for _ in range(2))
    x = interpolate(real, fake)

    def loss() -> Tensor:
        return model(fake).mean() - model(real).mean()

    def library() -> None:
        (loss() + gp(model(x), x)).backward()

    def hand() -> None:
        g = grad_of(model(x), x)
        (loss() + 10.0 * (g.norm(2, dim=1) - 1).square().mean()).backward()

    return Steps(library, hand, (x, real, fake), model, gp)


def r1_steps(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Steps:
    model, penalty = critic(device, dtype), r1(10.0)
    real = as_points(torch.randn(8, 16, device=device, dtype=dtype))

    def library() -> None:
        scores = model(real)
        (F.softplus(-scores).mean() + penalty(scores, real)).backward()

    def hand() -> None:
        scores = model(real)
        g = grad_of(scores, real)
        (F.softplus(-scores).mean() + 5.0 * g.square().sum(1).mean()).backward()

    return Steps(library, hand, (real,), model, penalty)


def double_backprop_steps(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Steps:
    model, penalty = classifier(device, dtype), double_backprop(0.1)
    x = as_points(torch.randn(8, 16, device=device, dtype=dtype))
    y = torch.randint(0, 4, (8,), device=device)

    def library() -> None:
        losses = F.cross_entropy(model(x), y, reduction="none")
        (losses.mean() + penalty(losses, x)).backward()

    def hand() -> None:
        losses = F.cross_entropy(model(x), y, reduction="none")
        g = grad_of(losses, x)
        (losses.mean() + 0.1 * g.square().sum(1).mean()).backward()

    return Steps(library, hand, (x,), model, penalty)


def parameter_shift_steps(penalty: GradientPenalty, second_pass: Callable[..., None],
                          device: str, dtype: torch.dtype) -> Steps:
    """``penalty``'s two-pass step on a classifier, and its twin: one backward, then
    ``second_pass(params, loss, zero_grad)`` as the reference implementation writes it."""
    model = classifier(device, dtype)
    params = list(model.parameters())
    x = torch.randn(8, 16, device=device, dtype=dtype)
    y = torch.randint(0, 4, (8,), device=device)

    def loss() -> Tensor:
        return F.cross_entropy(model(x), y)

    def library() -> None:
        model.zero_grad()
        penalized_backward(penalty, LossAt.run(loss, x), params)

    def hand() -> None:
        model.zero_grad()
        loss().backward()
        second_pass(params, loss, model.zero_grad)

    return Steps(library, hand, (x,), model, penalty)


def sharpness_second_pass(shifts_of: Callable[[list[Tensor]], list[Tensor]]
                          ) -> Callable[..., None]:
    """davda54/sam's second step: shift by ``shifts_of(params)`` (read from ``.grad``), take the
    gradient there, shift back."""
    def second_pass(params: list[Tensor], loss: Callable[[], Tensor],
                    zero_grad: Callable[[], None]) -> None:
        shifts = shifts_of(params)
        with torch.no_grad():
            for p, e in zip(params, shifts, strict=True):
                p.add_(e)
        zero_grad()
        loss().backward()
        with torch.no_grad():
            for p, e in zip(params, shifts, strict=True):
                p.sub_(e)

    return second_pass


def sam_steps(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Steps:
    rho = 0.05

    def shifts(params: list[Tensor]) -> list[Tensor]:  # davda54/sam
        norm = torch.sqrt(sum(p.grad.square().sum() for p in params))
        return [p.grad * (rho / norm) for p in params]

    return parameter_shift_steps(sam(rho), sharpness_second_pass(shifts), device, dtype)


def asam_steps(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Steps:
    rho = 0.5

    def shifts(params: list[Tensor]) -> list[Tensor]:  # davda54/sam with adaptive=True
        norm = torch.norm(torch.stack([(p.abs() * p.grad).norm(2) for p in params]), 2)
        scale = rho / (norm + 1e-12)
        return [p.pow(2) * p.grad * scale for p in params]

    return parameter_shift_steps(asam(rho), sharpness_second_pass(shifts), device, dtype)


def gr_steps(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Steps:
    lam, eps = 1e-3, 1e-3

    def second_pass(params: list[Tensor], loss: Callable[[], Tensor],
                    zero_grad: Callable[[], None]) -> None:
        # g + (lam / eps) (grad L(theta + eps g) - g), g = grad L(theta)
        g = [p.grad.clone() for p in params]
        with torch.no_grad():
            torch._foreach_add_(params, g, alpha=eps)
        zero_grad()
        loss().backward()
        with torch.no_grad():
            torch._foreach_sub_(params, g, alpha=eps)
            torch._foreach_lerp_(g, [p.grad for p in params], lam / eps)
        for p, t in zip(params, g, strict=True):
            p.grad = t

    return parameter_shift_steps(gr(lam, scale=eps), second_pass, device, dtype)


def path_length_steps(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Steps:
    torch.manual_seed(0)
    model, penalty = WPlusGenerator().to(device, dtype), path_length()
    ws = as_points(torch.randn(8, 4, 8, device=device, dtype=dtype))
    pl_mean = torch.zeros((), device=device, dtype=dtype)

    def library() -> None:
        penalty(model(ws), ws).backward()

    def hand() -> None:  # stylegan2-ada-pytorch's training/loss.py, Gpl phase (gain 1, one rank)
        img = model(ws)
        pl_noise = torch.randn_like(img) / math.sqrt(img.shape[2] * img.shape[3])
        (pl_grads,) = torch.autograd.grad((img * pl_noise).sum(), ws, create_graph=True)
        pl_lengths = pl_grads.square().sum(2).mean(1).sqrt()
        mean = pl_mean.lerp(pl_lengths.mean(), 0.01)
        pl_mean.copy_(mean.detach())
        ((pl_lengths - mean).square() * 2.0).mean().backward()

    return Steps(library, hand, (ws,), model, penalty)


STEPS = {"wgan_gp": wgan_gp_steps, "r1": r1_steps, "double_backprop": double_backprop_steps,
         "sam": sam_steps, "asam": asam_steps, "gr": gr_steps, "path_length": path_length_steps}


#: The releases counted: the ops a step dispatches are torch's decompositions, which an older
#: release writes otherwise (torch's own norm backward in the hand-written twin among them).
COUNTED = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)


@pytest.mark.skipif(not COUNTED, reason="the op counts are those of torch >= 2.13")
@pytest.mark.parametrize("name", STEPS)
def test_no_more_ops_than_by_hand(name: str) -> None:
    step = STEPS[name]()
    ours, theirs = counted(step.library), counted(step.hand)
    extra = ours - theirs
    allowed = LIMIT * sum(theirs.values()) + NOT_IN_THE_TWIN.get(name, 0)
    assert sum(ours.values()) <= allowed, (
        f"{name}: {sum(ours.values())} ops, by hand {sum(theirs.values())}; extra: {dict(extra)}")


@pytest.mark.parametrize("name", STEPS)
def test_each_step_computes_its_twins_parameter_gradients(name: str) -> None:
    """In float64, three calls of each (path length's running mean moves between them), the same
    random draws for both: the parameter gradients agree to 1e-10 (the sum of different
    roundings, not different math)."""
    step = STEPS[name](dtype=torch.float64)
    params = list(step.model.parameters())
    grads = []
    for run in (step.library, step.hand):
        torch.manual_seed(1)
        got = []
        for _ in range(3):
            for p in params:
                p.grad = None
            run()
            got += [p.grad.clone() for p in params]
        grads.append(got)
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["wgan_gp", "r1", "double_backprop"])
def test_the_penalty_step_makes_no_host_sync_and_is_captured_in_a_cuda_graph(name: str) -> None:
    """The step (forward, penalty, backward) runs under ``set_sync_debug_mode("error")`` and is
    captured in one CUDA graph; the replay on new points gives the eager step's parameter
    gradients, and NaN points are reported by ``settle()`` after a replay."""
    step = STEPS[name]("cuda")
    params = list(step.model.parameters())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: the first call's checks, the allocator's pools
            step.library()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step.library()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.current_stream().wait_stream(side)
    step.penalty.finite_check.settle()
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.library()
    torch.manual_seed(1)
    with torch.no_grad():
        for x in step.inputs:
            x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [p.grad.clone() for p in params]
    step.penalty.finite_check.settle()  # finite: nothing raised
    for p in params:
        p.grad = None
    step.library()
    for a, p in zip(replayed, params, strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        step.inputs[0][0, 0] = float("nan")
    graph.replay()
    with pytest.raises(NonFiniteError, match="contain NaN or Inf"):
        step.penalty.finite_check.settle()


if __name__ == "__main__":  # the table: python -m tests.test_op_counts
    for name, steps in STEPS.items():
        step = steps()
        ours, theirs = counted(step.library), counted(step.hand)
        print(f"| {name} | {sum(ours.values())} | {sum(theirs.values())} | "
              f"{sum(ours.values()) / sum(theirs.values()):.2f}x | {dict(ours - theirs)} | "
              f"{dict(theirs - ours)} |")
