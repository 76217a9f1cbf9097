"""The benchmark's report: the machine, the printed and Markdown tables, the log-log plot."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def machine(device: torch.device) -> dict:
    """The CPU model, the GPU, the torch and Python versions and the thread count."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"cpu": cpu, "gpu": gpu, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "cpus": os.cpu_count()}


#: (heading, row key, format, text width) of each column of the printed and Markdown tables.
COLUMNS = (("case", "case", "", 26), ("batch", "batch", "d", 5), ("width", "width", "d", 5),
           ("params", "parameters", "d", 8), ("method", "method", "", 17),
           ("median ms", "median_ms", ".2f", 9), ("× plain", "ratio", ".2f", 7),
           ("peak MB", "peak_mb", ".1f", 8),
           ("FLOPs × plain", "flop_ratio", ".2f", 13),
           ("peak mem × plain", "memory_ratio", ".2f", 16), ("rel. error", "error", ".1e", 10))


def cells(row: dict) -> list[str]:
    """The row's formatted values, one per column ("–" where a value does not apply); a method
    that refused the case has its error in place of the measurements."""
    if "refused" in row:
        return [format(row[key], spec) for _, key, spec, _ in COLUMNS[:5]] + [
            f"refused: {row['refused']}"] + [""] * (len(COLUMNS) - 6)
    return ["–" if row.get(key) is None else format(row[key], spec)
            for _, key, spec, _ in COLUMNS]


def table(rows: list[dict]) -> str:
    """The rows as aligned text, as printed after each case."""
    def line(values: list[str]) -> str:  # text columns to the left, numbers to the right
        return " ".join(f"{v:{'<' if spec == '' else '>'}{width}}"
                        for v, (_, _, spec, width) in zip(values, COLUMNS, strict=True)).rstrip()

    return "\n".join([line([head for head, *_ in COLUMNS])] + [line(cells(r)) for r in rows])


def markdown(rows: list[dict]) -> str:
    """The rows as the Markdown table of docs/benchmarks.md."""
    lines = ["| " + " | ".join(head for head, *_ in COLUMNS) + " |",
             "|" + "|".join("---" if spec == "" else "---:" for _, _, spec, _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Log-log step time against batch size and against parameter count, per case and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_batch, by_params) = plt.subplots(1, 2, figsize=(11, 4.5))
    timed = [r for r in rows if "median_ms" in r]
    colors = {"plain": "black", "hand": "tab:orange", "exact": "tab:blue",
              "finite_difference": "tab:green"}  # color: method; line style and marker: case
    for (case, style) in zip(sorted({r["case"] for r in timed}), ("-o", "--s", ":^", "-.v"),
                             strict=False):
        widths = [r["width"] for r in timed if r["case"] == case]
        width = max(set(widths), key=widths.count)  # the width most cases ran at
        batches = [r["batch"] for r in timed if r["case"] == case]
        batch = max(set(batches), key=batches.count)
        for method, color in colors.items():
            mine = [r for r in timed if r["case"] == case and r["method"] == method]
            for ax, x, fixed, value in ((by_batch, "batch", "width", width),
                                        (by_params, "parameters", "batch", batch)):
                pts = sorted((r[x], r["median_ms"]) for r in mine if r[fixed] == value)
                if len(pts) > 1:
                    ax.plot(*zip(*pts, strict=True), style, color=color,
                            label=f"{case} {method}")
    for ax, xlabel in ((by_batch, "batch size"), (by_params, "parameters")):
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="step time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
