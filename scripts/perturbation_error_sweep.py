"""The perturbation estimate of R1's squared norm against the exact one, over the probe scale σ.

For a DCGAN critic of 3x32x32 images (LeakyReLU, as trained, and tanh), unit-normal images and
the same probes in every precision (one seed), per σ and difference (forward, central):

* bias: mean over samples and probes of (estimate − (εᵀg)²), relative to the mean ‖g‖², where
  g = ∇D(x) by float64 autograd and (εᵀg)² is the σ → 0 limit with the same probe: the
  systematic error, free of the probes' sampling noise;
* error: the root mean square of the same difference, relative to the mean ‖g‖²: what one probe
  adds to the sampling noise of (εᵀg)² (relative std √2 per probe for a scalar score).

float64 is the reference (truncation only); float32 adds rounding; bf16 runs the critic under CPU
autocast. Prints a Markdown table.

    python scripts/perturbation_error_sweep.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradreg.models import DCGANCritic
from gradreg.penalties.methods.perturbation import perturbation_sq_norms

SIGMAS = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
PRECISIONS = ("float64", "float32", "bf16")


def limits(critic: nn.Module, x: Tensor, probes: int, seed: int) -> tuple[Tensor, Tensor]:
    """(‖g_i‖², (ε_iᵀ g_i)² per probe [probes, B]) in float64, the probes drawn as the estimate
    draws them."""
    points = x.double().requires_grad_()
    (g,) = torch.autograd.grad(critic.double()(points).sum(), points)
    generator = torch.Generator().manual_seed(seed)
    eps = torch.stack([torch.randn(x.shape, generator=generator).double() for _ in range(probes)])
    return g.flatten(1).square().sum(1), (eps * g).flatten(2).sum(2).square()


def estimates(critic: nn.Module, x: Tensor, precision: str, sigma: float, central: bool,
              probes: int, seed: int) -> Tensor:
    """One estimate per probe and sample [probes, B], in ``precision``."""
    generator = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if precision == "float64" else torch.float32
    model, points = critic.to(dtype), x.to(dtype)
    rows = []
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        for _ in range(probes):
            rows.append(perturbation_sq_norms(lambda q: model(q).float().double(), points,
                                              step=sigma, central=central,
                                              generator=generator).double())
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--probes", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, batch {args.batch}, {args.probes} probes per sample")
    header = ["critic", "σ", "difference"] + [f"{p} {m}" for p in PRECISIONS
                                              for m in ("bias", "error")]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for activation in (None, "tanh"):
        torch.manual_seed(0)
        critic = DCGANCritic((3, 32, 32), 32, activation=activation)
        x = torch.randn(args.batch, 3, 32, 32, dtype=torch.float64)
        exact, limit = limits(critic, x, args.probes, seed=1)
        scale = exact.mean()
        spread = (limit / exact).std().item()
        for sigma in SIGMAS:
            for central in (False, True):
                cells = []
                for precision in PRECISIONS:
                    diff = estimates(critic, x, precision, sigma, central, args.probes, 1) - limit
                    cells += [f"{(diff.mean() / scale).item():+.1e}",
                              f"{(diff.square().mean().sqrt() / scale).item():.1e}"]
                name = "leaky_relu" if activation is None else activation
                print(f"| {name} | {sigma:g} | {'central' if central else 'forward'} | "
                      + " | ".join(cells) + " |")
        print(f"<!-- {activation}: relative std of (εᵀg)²/‖g‖² per probe {spread:.2f} -->")


if __name__ == "__main__":
    main()
