"""The finite-difference step against the arithmetic: relative error of the penalty's parameter
gradient (against float64 double backward on the same points) for float32 and for TF32 emulated
on the CPU (``tests/tf32.py``), over steps, activations and the benchmark's model shapes.

    python scripts/fd_error_sweep.py                     # the table in docs/benchmarks.md
    python scripts/fd_error_sweep.py --steps 0.1,0.3,0.5,1

Prints one Markdown row per (model, activation): errors at each step, float32 then TF32.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradreg.penalties import as_points, interpolate, make_penalty
from tests.tf32 import EmulatedTF32

ACTIVATIONS = {"tanh": nn.Tanh, "elu": nn.ELU, "softplus": nn.Softplus, "silu": nn.SiLU}


def model_and_penalty(kind: str, act: type[nn.Module]) -> tuple[nn.Module, str, Tensor, tuple]:
    """(model, preset, points, fn_args) of the benchmark's shapes, seeded."""
    torch.manual_seed(0)
    if kind == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), act(), nn.Linear(256, 256),
                              act(), nn.Linear(256, 10))
        return model, "double_backprop", torch.randn(64, 784), (torch.randint(0, 10, (64,)),)
    if kind == "cnn":
        model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), act(),
                              nn.Conv2d(16, 16, 3, padding=1), act(), nn.AvgPool2d(2),
                              nn.Flatten(), nn.Linear(16 * 16, 10))
        return model, "double_backprop", torch.randn(64, 1, 8, 8), (torch.randint(0, 10, (64,)),)
    model = nn.Sequential(nn.Conv2d(3, 16, 4, 2, 1), act(), nn.Conv2d(16, 32, 4, 2, 1), act(),
                          nn.Conv2d(32, 64, 4, 2, 1), act(), nn.Flatten(),
                          nn.Linear(64 * 4 * 4, 1), nn.Flatten(0))
    real, fake = torch.randn(32, 3, 32, 32), torch.randn(32, 3, 32, 32)
    preset = kind.split("_", 1)[1]
    return model, preset, (interpolate(real, fake) if preset == "wgan_gp" else real), ()


def gradient(model: nn.Module, preset: str, points: Tensor, fn_args: tuple,
             **options: object) -> Tensor:
    fn: Callable[..., Tensor] = (
        (lambda q, y: F.cross_entropy(model(q), y, reduction="none")) if fn_args else model)
    p = as_points(points)
    outputs = fn if options else fn(p, *fn_args)
    value = make_penalty(preset, **options)(outputs, p, fn_args=fn_args if options else ())
    params = list(model.parameters())
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(w) if g is None else g).flatten()
                      for w, g in zip(params, grads, strict=True)])


def errors(kind: str, act: type[nn.Module], steps: list[float]) -> dict[tuple[str, float], float]:
    model, preset, points, fn_args = model_and_penalty(kind, act)
    model64 = copy.deepcopy(model).double()
    exact = gradient(model64, preset, points.detach().double(), fn_args)
    out = {}
    for arithmetic in ("float32", "tf32"):
        for step in steps:
            with EmulatedTF32() if arithmetic == "tf32" else torch.enable_grad():
                estimate = gradient(model, preset, points.detach(), fn_args,
                                    method="finite_difference", step=step)
            out[arithmetic, step] = float((estimate.double() - exact).norm() / exact.norm())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="0.01,0.5")
    parser.add_argument("--kinds", default="mlp,cnn,critic_wgan_gp,critic_r1")
    parser.add_argument("--activations", default=",".join(ACTIVATIONS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = [float(s) for s in args.steps.split(",")]
    columns = [f"{a} {s:g}" for a in ("float32", "tf32") for s in steps]
    print("| model | activation | " + " | ".join(columns) + " |")
    print("|---|---|" + "---:|" * len(columns))
    for kind in args.kinds.split(","):
        for name in args.activations.split(","):
            row = errors(kind, ACTIVATIONS[name], steps)
            print(f"| {kind} | {name} | " + " | ".join(f"{v:.1e}" for v in row.values()) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
