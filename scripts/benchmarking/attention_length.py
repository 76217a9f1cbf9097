"""Exact R1 through attention against the sequence length: time and peak memory of one step.

A critic of sequences: a 2-layer ``nn.TransformerEncoder`` (width 64, 4 heads, feed-forward 256,
no dropout, post-norm), the mean over positions, a linear head; batch 2 of L random tokens. Each
step is zero_grad, the non-saturating loss at the reals and the fakes, R1 (weight 10) at the
reals sharing their forward with the loss, backward, an SGD update. Methods: ``plain`` (the loss
alone, torch's fused CPU attention), ``exact`` (R1 through :func:`gradreg.differentiable_attention`
around the reals' forward), ``math`` (R1 with ``sdpa_kernel(SDPBackend.MATH)`` around the same
forward: both exact methods run the fakes through the fused kernel).

Each (method, L) runs in a process of its own, one thread: the peak resident memory of its first
step above the resident memory before it (``VmHWM``, reset before the step), then the process
CPU time of the next steps (median). FLOPs (matrix products, torch's formulas,
:func:`benchmarking.timing.count_flops`)
are counted at L = 256 and 512, where they are exactly ``a L + b L^2``, and extrapolated, with
the fused forwards counted as MATH's matrix products (:func:`flops`); the ``math`` step's FLOPs
over the plain step's is the floor of exact R1's time ratio.

    PYTHONPATH=scripts python -m benchmarking.attention_length --lengths 256 512 1024 2048
    PYTHONPATH=scripts python -m benchmarking.attention_length --report  # table and figure
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarking.transformer import Step, r1_steps

METHODS = ("plain", "exact", "math")


class SequenceCritic(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x).mean(dim=1)).squeeze(-1)


def steps(length: int, batch: int = 2, dim: int = 64) -> tuple[nn.Module, dict[str, Step]]:
    """The critic and its steps (:func:`benchmarking.transformer.r1_steps`) at length L."""
    torch.manual_seed(0)
    critic = SequenceCritic(dim)
    real, fake = torch.randn(batch, length, dim), torch.randn(batch, length, dim)
    return critic, r1_steps(critic, real, fake)


def status_mb(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in MB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def reset_peak() -> None:
    """Starts ``VmHWM`` afresh (``ru_maxrss`` cannot be reset, and a child process's starts at
    least at its parent's resident memory at the fork)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(method: str, length: int, timed_steps: int) -> dict:
    """One process: the first step's peak memory growth, then the CPU time of the next."""
    torch.set_num_threads(1)
    critic, losses = steps(length)
    optimizer = torch.optim.SGD(critic.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        losses[method]().backward()
        optimizer.step()

    before = status_mb("VmRSS")
    reset_peak()
    step()
    peak = status_mb("VmHWM")
    seconds = []
    for _ in range(timed_steps):
        start = time.process_time()
        step()
        seconds.append(time.process_time() - start)
    return {"method": method, "length": length, "memory_mb": peak - before,
            "seconds": statistics.median(seconds)}


def flops(length: int) -> dict[str, float]:
    """Matrix-product FLOPs of one step per method, each run with MATH attention where it runs
    the fused kernel (torch's formulas count no fused kernel; MATH's forward is its matrix
    products): ``plain``, ``math``, and ``exact`` (its fused forwards counted as MATH's, its
    blockwise backward as it runs)."""
    from benchmarking.timing import count_flops

    critic, losses = steps(length)

    def counted(method: str) -> float:
        def run() -> None:
            critic.zero_grad(set_to_none=True)
            with sdpa_kernel(SDPBackend.MATH):
                losses[method]().backward()
        return count_flops(run, 1)

    return {method: counted(method) for method in METHODS}


def flop_fit() -> dict[str, tuple[float, float]]:
    """(a, b) of each method's FLOPs a L + b L^2, solved from L = 256 and 512."""
    small, large = flops(256), flops(512)
    fit = {}
    for method in METHODS:
        b = (large[method] / 512 - small[method] / 256) / 256
        fit[method] = (small[method] / 256 - b * 256, b)
    return fit


def sweep(lengths: list[int], math_up_to: int, out: Path) -> list[dict]:
    rows = []
    for length in lengths:
        for method in METHODS:
            if method == "math" and length > math_up_to:
                continue
            timed = 3 if length <= 1024 else 1
            result = subprocess.run(
                [sys.executable, "-m", "benchmarking.attention_length", "--one", method,
                 "--lengths", str(length), "--timed-steps", str(timed)],
                check=True, capture_output=True, text=True)
            rows.append(json.loads(result.stdout))
            print(rows[-1], flush=True)
            out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    out.write_text(json.dumps({"rows": rows, "flops_per_L_and_L2": flop_fit()}, indent=1)
                   + "\n")
    return rows


def flop_floor(fit: dict, length: int) -> dict[str, float]:
    """The counted FLOPs at ``length`` over the plain step's."""
    def at(key: str) -> float:
        a, b = fit[key]
        return a * length + b * length**2
    return {"math": at("math") / at("plain"), "exact": at("exact") / at("plain")}


def table(data: dict) -> str:
    """The markdown table of a sweep: per length, each method's CPU time and peak memory
    growth, as ratios to the plain step's, and the FLOP floor."""
    rows = {(r["length"], r["method"]): r for r in data["rows"]}
    lines = ["| L | plain s | plain MB | exact R1 s (× plain, × MATH) | exact R1 MB (× plain) | "
             "MATH s (× plain) | MATH MB (× plain) | FLOPs × plain: MATH, blockwise |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for length in sorted({r["length"] for r in data["rows"]}):
        plain, exact = rows[length, "plain"], rows[length, "exact"]
        math = rows.get((length, "math"))
        floor = flop_floor(data["flops_per_L_and_L2"], length)
        vs_math = f", {exact['seconds'] / math['seconds']:.2f}" if math else ""
        cells = [f"{length}", f"{plain['seconds']:.2f}", f"{plain['memory_mb']:.0f}",
                 f"{exact['seconds']:.2f} ({exact['seconds'] / plain['seconds']:.1f}x{vs_math})",
                 f"{exact['memory_mb']:.0f} ({exact['memory_mb'] / plain['memory_mb']:.2f}x)"]
        if math:
            cells += [f"{math['seconds']:.2f} ({math['seconds'] / plain['seconds']:.1f}x)",
                      f"{math['memory_mb']:.0f} ({math['memory_mb'] / plain['memory_mb']:.1f}x)"]
        else:
            cells += ["not run", "not run"]
        cells.append(f"{floor['math']:.1f}, {floor['exact']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(data: dict, path: Path) -> None:
    """Time and peak memory growth against L, log-log, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(10, 4))
    labels = {"plain": "plain step (fused attention)",
              "exact": "exact R1, gradreg (blockwise)", "math": "exact R1, MATH"}
    for method, label in labels.items():
        points = sorted((r["length"], r["seconds"], r["memory_mb"]) for r in data["rows"]
                        if r["method"] == method)
        lengths = [p[0] for p in points]
        time_axis.plot(lengths, [p[1] for p in points], "o-", label=label)
        memory_axis.plot(lengths, [p[2] for p in points], "o-", label=label)
    plain = {r["length"]: r["seconds"] for r in data["rows"] if r["method"] == "plain"}
    lengths = sorted(plain)
    time_axis.plot(lengths, [plain[n] * flop_floor(data["flops_per_L_and_L2"], n)["math"]
                             for n in lengths], "k:", label="FLOP floor (plain x MATH's FLOPs)")
    for axis, name in ((time_axis, "CPU seconds per step"),
                       (memory_axis, "peak memory growth of a step, MB")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length L")
        axis.set_ylabel(name)
        axis.grid(True, which="both", alpha=0.3)
    time_axis.legend(fontsize=8)
    fig.suptitle("2-layer TransformerEncoder critic (d=64, 4 heads, batch 2), one CPU thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--one", choices=METHODS, help="measure one method in this process")
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument("--math-up-to", type=int, default=4096,
                        help="the longest sequence the MATH step runs at")
    parser.add_argument("--out", type=Path, default=Path("docs/measured/attention_length.json"))
    parser.add_argument("--report", action="store_true",
                        help="print the table of --out and draw docs/attention_length.png")
    args = parser.parse_args()
    if args.report:
        data = json.loads(args.out.read_text())
        print(table(data))
        figure(data, Path("docs/attention_length.png"))
        return
    if args.one:
        print(json.dumps(measure(args.one, args.lengths[0], args.timed_steps)))
        return
    sweep(args.lengths, args.math_up_to, args.out)


if __name__ == "__main__":
    main()
