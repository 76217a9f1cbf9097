"""Penalties through attention: a ViT critic with R1 and a transformer classifier with
``param_grad_norm``, per method, against the plain step with the fused attention kernel.

Methods of the critic (non-saturating loss; R1 differentiates the loss's own real scores):
``plain`` (the loss alone, fused kernel), ``exact`` (R1 by double backward through
:func:`gradreg.differentiable_attention`, around the real scores' forward only), ``math`` (the
same step with ``sdpa_kernel(SDPBackend.MATH)`` around the same forward, the only reference
torch offers: both exact methods run the fakes through the fused kernel), ``approx_r1`` (the
perturbation estimate, the forward at the reals shared with the loss). Methods of the
classifier (cross-entropy): ``plain``, ``gnp_exact`` (``param_grad_norm`` by double backward
through differentiable attention), ``gnp_math`` (the same under the MATH backend), ``gnp_fd``
(``method="finite_difference"``, Zhao et al.'s two gradients, the loss shared through
``LossAt``).

Each step is zero_grad, forward, backward, an SGD update. Times (wall, or process CPU time with
``--clock cpu``) are medians over rounds of the ratio to the plain step of the same round
(methods interleaved round-robin); peak memory is the
tensor memory of one step above what is alive before it (:func:`benchmarking.timing
.peak_memory`), as a ratio to the plain step's too.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarking.timing import peak_memory, synchronize
from gradreg import differentiable_attention
from gradreg.models import TransformerClassifier, ViTCritic
from gradreg.penalties import as_points, presets
from gradreg.penalties.methods.param_gradient import LossAt

Step = Callable[[], Tensor]


def sizes(quick: bool, suite: str) -> dict:
    """The models' sizes: the CPU suite's ViT of 3x32x32 images in 4x4 patches (64 tokens),
    width 64, 4 layers, 4 heads, batch 32; ``gpu``: 3x64x64 in 4x4 patches (256 tokens), width
    256, 6 layers, 8 heads, batch 64; ``quick``: a tiny one."""
    if quick:
        return {"image": (3, 16, 16), "patch": 4, "dim": 16, "depth": 1, "heads": 2, "batch": 4}
    if suite == "gpu":
        return {"image": (3, 64, 64), "patch": 4, "dim": 256, "depth": 6, "heads": 8,
                "batch": 64}
    return {"image": (3, 32, 32), "patch": 4, "dim": 64, "depth": 4, "heads": 4, "batch": 32}


def critic_steps(size: dict, device: torch.device) -> tuple[nn.Module, dict[str, Step]]:
    torch.manual_seed(0)
    critic = ViTCritic(size["image"], size["dim"], patch=size["patch"], depth=size["depth"],
                       heads=size["heads"]).to(device)
    real = torch.rand(size["batch"], *size["image"], device=device)
    fake = torch.rand(size["batch"], *size["image"], device=device)
    return critic, r1_steps(critic, real, fake)


def r1_steps(critic: nn.Module, real: Tensor, fake: Tensor) -> dict[str, Step]:
    """The critic's non-saturating loss at ``real`` and ``fake`` alone (``plain``), and with R1
    (weight 10) at the reals sharing their forward: exact through differentiable attention
    (``exact``) or the MATH backend (``math``), each around the reals' forward only (the fakes
    run the fused kernel), or estimated without a double backward (``approx_r1``)."""
    r1, approx = presets.r1(10.0), presets.approx_r1(10.0)

    def loss(d_real: Tensor) -> Tensor:
        return F.softplus(critic(fake)).mean() + F.softplus(-d_real).mean()

    def plain() -> Tensor:
        return loss(critic(real))

    def exact(context: Callable = differentiable_attention) -> Tensor:
        x = as_points(real)
        with context():  # around the reals' forward only: the fakes run the fused kernel
            d_real = critic(x)
        return loss(d_real) + r1(d_real, x)

    def approx_r1() -> Tensor:
        x = as_points(real)
        d_real = critic(x)
        return loss(d_real) + approx(lambda q: d_real if q is x else critic(q), x)

    return {"plain": plain, "exact": exact,
            "math": lambda: exact(lambda: sdpa_kernel(SDPBackend.MATH)), "approx_r1": approx_r1}


def classifier_steps(size: dict, device: torch.device) -> tuple[nn.Module, dict[str, Step]]:
    torch.manual_seed(0)
    model = TransformerClassifier(10, image_shape=size["image"], patch=size["patch"],
                                  dim=size["dim"], depth=size["depth"],
                                  heads=size["heads"]).to(device)
    x = torch.rand(size["batch"], *size["image"], device=device)
    y = torch.randint(0, 10, (size["batch"],), device=device)
    params = list(model.parameters())
    exact, fd = presets.param_grad_norm(0.1), presets.param_grad_norm(0.1,
                                                                       method="finite_difference")

    def task() -> Tensor:
        return F.cross_entropy(model(x), y)

    def gnp_exact(context: Callable = differentiable_attention) -> Tensor:
        with context():
            loss = task()
            return loss + exact(loss, params)

    def gnp_fd() -> Tensor:
        loss = task()
        return loss + fd(LossAt(task, loss), params)

    return model, {"plain": task, "gnp_exact": gnp_exact,
                   "gnp_math": lambda: gnp_exact(lambda: sdpa_kernel(SDPBackend.MATH)),
                   "gnp_fd": gnp_fd}


def run_case(name: str, model: nn.Module, steps: dict[str, Step], rounds: int,
             device: torch.device, clock: Callable[[], float]) -> list[dict]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(method: str) -> None:
        optimizer.zero_grad(set_to_none=True)
        steps[method]().backward()
        optimizer.step()

    def timed(method: str) -> float:
        synchronize(device)
        start = clock()
        step(method)
        synchronize(device)
        return clock() - start

    for method in steps:  # warm-up
        step(method)
    ratios: dict[str, list[float]] = {m: [] for m in steps}
    seconds: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(rounds):
        times = {m: timed(m) for m in steps}
        for m, t in times.items():
            ratios[m].append(t / times["plain"])
            seconds[m].append(t)
    memory = {}
    for method in steps:
        optimizer.zero_grad(set_to_none=True)
        memory[method] = peak_memory(lambda method=method: steps[method]().backward(), device)
    return [{"case": name, "method": m, "ms": 1e3 * statistics.median(seconds[m]),
             "ratio": statistics.median(ratios[m]), "memory_mb": memory[m] / 2**20,
             "memory_ratio": memory[m] / memory["plain"]} for m in steps]


def table(rows: list[dict]) -> str:
    lines = ["| case | method | ms | time / plain | peak MB | memory / plain |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['method']} | {r['ms']:.1f} | {r['ratio']:.2f} | "
              f"{r['memory_mb']:.1f} | {r['memory_ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


def main(quick: bool, suite: str, device: torch.device, rounds: int | None,
         clock: Callable[[], float]) -> list[dict]:
    size = sizes(quick, suite)
    rounds = rounds or (3 if quick else 15)
    rows = []
    for name, build in (("vit_critic/r1", critic_steps),
                        ("transformer_classifier/param_grad_norm", classifier_steps)):
        rows += run_case(name, *build(size, device), rounds, device, clock)
    print(table(rows), flush=True)
    return rows
