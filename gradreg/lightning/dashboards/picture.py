"""A static picture of a logged run: what TensorBoard shows for it (the custom-scalars charts and
the latest images), read from its event files, for reports where no browser is at hand."""

from __future__ import annotations

import io
import itertools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gradreg.lightning.dashboards.charts import custom_scalars_layout
from gradreg.lightning.dashboards.tags import CRITIC_LANDSCAPE, SALIENCY


def snapshot(
    runs: Mapping[str, str | Path],
    *,
    layout: Mapping[str, Mapping[str, list]] | None = None,
    images: Sequence[str] = (SALIENCY, f"{CRITIC_LANDSCAPE}/grad_norm"),
) -> Figure:
    """A static picture of what TensorBoard shows for ``runs`` (name -> run directory).

    One panel per chart of the custom-scalars ``layout`` (default :func:`custom_scalars_layout`)
    that some run has data for, each run's matching scalar tags drawn against the step, then
    each run's latest image of every tag in ``images``. For reports and READMEs where no
    browser is at hand; it reads the event files exactly as TensorBoard does (the whole run
    directory).
    """
    accumulators = {name: _load(path) for name, path in runs.items()}
    charts = [
        (title, regexes)
        for category in (layout or custom_scalars_layout()).values()
        for title, (_, regexes) in category.items()
        if any(re.match(regex, tag) for acc in accumulators.values()
               for tag in acc.Tags()["scalars"] for regex in regexes)
    ]
    pictures = [
        (f"{name}: {tag}", acc.Images(tag)[-1])
        for name, acc in accumulators.items()
        for tag in images
        if tag in acc.Tags()["images"]
    ]
    columns = 3
    chart_rows = -(-len(charts) // columns)
    fig = Figure(figsize=(4.2 * columns, 2.8 * chart_rows + 3.2 * len(pictures)), dpi=72,
                 layout="constrained")
    grid = fig.add_gridspec(chart_rows + len(pictures), columns,
                            height_ratios=[2.8] * chart_rows + [3.2] * len(pictures))
    for k, (title, regexes) in enumerate(charts):
        ax = fig.add_subplot(grid[k // columns, k % columns])
        _draw_chart(ax, title, regexes, accumulators)
    for k, (title, image) in enumerate(pictures):
        ax = fig.add_subplot(grid[chart_rows + k, :])
        ax.imshow(_decode(image.encoded_image_string))
        ax.set_title(f"{title} (step {image.step})", fontsize=9)
        ax.axis("off")
    return fig


def _load(path: str | Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    return accumulator


def _draw_chart(ax, title: str, regexes: Sequence[str], runs: Mapping[str, EventAccumulator]):
    """One colour per run (as TensorBoard), one line style per matching tag."""
    for colour, (name, acc) in enumerate(runs.items()):
        tags = [tag for tag in acc.Tags()["scalars"] if any(re.match(r, tag) for r in regexes)]
        for tag, style in zip(tags, itertools.cycle(["-", "--", ":", "-."])):
            events = acc.Scalars(tag)
            ax.plot([e.step for e in events], [e.value for e in events], color=f"C{colour}",
                    linestyle=style, label=f"{name}: {tag}" if len(runs) > 1 else tag)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    if ax.lines:
        ax.legend(fontsize=6)


def _decode(png: bytes) -> np.ndarray:
    return imread(io.BytesIO(png), format="png")
