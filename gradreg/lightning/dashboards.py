r"""TensorBoard dashboards for gradient penalties: tags, the custom-scalars layout, the figures.

Tag vocabulary (what the callbacks in :mod:`gradreg.lightning.callbacks` write):

=================================  ===============================================================
``grad_{p}_norm/<param>``          :math:`\lVert\partial L/\partial\theta\rVert_p` per parameter
                                   (Lightning's ``grad_norm``); ``grad_{p}_norm_total`` over all
``input_grad/norm_mean|max``       mean / max over the batch of the per-sample norms
                                   :math:`\lVert\nabla_{x_i}\ell_i\rVert_p`; their histogram is
                                   ``input_grad/norm``
``penalty/<module path>``          ``GradientPenalty.last_value``: the unweighted penalty
``penalty_weight/<module path>``   the weight a ``PenaltyWeightSchedule`` set
``saliency``                       image: inputs over :math:`\lvert\nabla_x\ell\rvert`
``critic_landscape``               image: critic scores, :math:`\lVert\nabla_x D\rVert`, samples
``samples``                        image: a grid of generated images of fixed latents
``autograd_graph/text|dot``        text: the backward graph of the penalized loss
``hp/<metric>``                    final metrics, shown with the hyperparameters (HParams tab)
=================================  ===============================================================

The figures are drawn on :class:`matplotlib.figure.Figure` objects (Agg, no pyplot state), so they
render headless and in threads; :func:`snapshot` renders a logged run as one static picture.
"""

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

__all__ = [
    "AUTOGRAD_GRAPH",
    "CRITIC_LANDSCAPE",
    "HPARAM_METRIC",
    "INPUT_GRAD",
    "PENALTY",
    "PENALTY_WEIGHT",
    "SALIENCY",
    "SAMPLES",
    "critic_landscape_figure",
    "custom_scalars_layout",
    "saliency_figure",
    "snapshot",
]

PENALTY = "penalty"
PENALTY_WEIGHT = "penalty_weight"
INPUT_GRAD = "input_grad"
SALIENCY = "saliency"
CRITIC_LANDSCAPE = "critic_landscape"
SAMPLES = "samples"
AUTOGRAD_GRAPH = "autograd_graph"
HPARAM_METRIC = "hp"

CATEGORY = "gradreg"


def custom_scalars_layout(
    loss: Sequence[str] = (r".*loss.*",), category: str = CATEGORY
) -> dict[str, dict[str, list]]:
    """The layout for ``SummaryWriter.add_custom_scalars``: loss, penalties and norms side by side.

    Each chart is ``["Multiline", [regex, ...]]``; TensorBoard draws every scalar tag that a regex
    matches from its start (``re.match``). ``loss`` are the regexes of the task-loss tags (the
    module's own ``self.log`` names). Penalties match both the monitor's ``penalty/...`` and a
    module's ``<stage>/penalty/...``.
    """
    return {
        category: {
            "task loss": ["Multiline", list(loss)],
            "penalties": ["Multiline", [rf"(.*/)?{PENALTY}/.*"]],
            "penalty weights": ["Multiline", [rf"{PENALTY_WEIGHT}/.*"]],
            "parameter gradient norm (total)": ["Multiline", [r"grad_.*_norm_total.*"]],
            "input gradient norm": ["Multiline", [rf"{INPUT_GRAD}/norm_(mean|max)"]],
        }
    }


def saliency_figure(
    images: np.ndarray, saliency: np.ndarray, labels: Sequence[int] | None = None
) -> Figure:
    r"""Inputs (top row) over :math:`\lvert\nabla_{x_i}\ell_i\rvert` (bottom row), one column each.

    ``images``: ``[N, H, W]`` (gray) or ``[N, H, W, 3]`` in [0, 1]; ``saliency``: ``[N, H, W]``,
    >= 0. Each map is scaled to its own maximum, to show *where* the loss is sensitive; under it
    is the sample's :math:`\lVert\nabla_{x_i}\ell_i\rVert_2`, the *how much* that runs with and
    without a penalty compare by.
    """
    n, _, width = saliency.shape
    fig = Figure(figsize=(0.75 * n + 1.2, 2.7), dpi=80)
    fig.subplots_adjust(left=0.04, right=0.96, top=0.9, bottom=0.1, hspace=0.5)
    top, bottom = fig.subplots(2, 1)
    top.imshow(_mosaic(images), cmap="gray_r" if images.ndim == 3 else None)
    peaks = saliency.reshape(n, -1).max(1).reshape(n, 1, 1)
    bottom.imshow(_mosaic(saliency / np.where(peaks > 0, peaks, 1.0)), cmap="magma", vmin=0, vmax=1)
    centers = (width + 1) * np.arange(n) + (width - 1) / 2
    norms = np.sqrt((saliency.reshape(n, -1) ** 2).sum(1))
    for ax, title, ticks in (
        (top, "input", [f"y={y}" for y in labels] if labels is not None else [""] * n),
        (bottom, r"$|\nabla_x \ell|$ / its max; below: $\|\nabla_x \ell\|$",
         [f"{v:.2g}" for v in norms]),
    ):
        ax.set_title(title, fontsize=9)
        ax.set_xticks(centers, ticks, fontsize=7)
        ax.set_yticks([])
        ax.tick_params(length=0)
    return fig


def _mosaic(tiles: np.ndarray) -> np.ndarray:
    """``[N, H, W(, C)]`` tiles side by side with a one-pixel blank column between them."""
    gap = np.full_like(tiles[0][:, :1], np.nan if tiles.ndim == 3 else 1.0)
    return np.concatenate([part for tile in tiles for part in (tile, gap)][:-1], axis=1)


def critic_landscape_figure(
    xs: np.ndarray,
    ys: np.ndarray,
    scores: np.ndarray,
    grad_norms: np.ndarray,
    real: np.ndarray,
    fake: np.ndarray,
) -> Figure:
    r"""The critic's scores :math:`D(x)` and gradient norms :math:`\lVert\nabla_x D(x)\rVert_2`.

    Two panels, the real and fake samples on both. ``xs``, ``ys``: the grid axes (``[W]``,
    ``[H]``); ``scores`` and ``grad_norms``: ``[H, W]`` on that grid; ``real``, ``fake``: ``[N, 2]``
    samples (dots and crosses; those outside the grid are cut off). The right panel draws the level
    :math:`\lVert\nabla D\rVert = 1`, WGAN-GP's target, where the field crosses it.
    """
    fig = Figure(figsize=(9.0, 4.0), dpi=80)
    fig.subplots_adjust(left=0.05, right=0.94, top=0.9, bottom=0.08, wspace=0.2)
    left, right = fig.subplots(1, 2, sharex=True, sharey=True)
    extent = (xs[0], xs[-1], ys[0], ys[-1])
    for ax, field, cmap, label in (
        (left, scores, "RdBu_r", "critic D(x)"),
        (right, grad_norms, "viridis", r"gradient norm $\|\nabla_x D(x)\|$"),
    ):
        shown = ax.imshow(field, origin="lower", extent=extent, cmap=cmap, aspect="auto")
        fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.02)
        ax.scatter(real[:, 0], real[:, 1], s=6, c="black", label="real")
        ax.scatter(fake[:, 0], fake[:, 1], s=10, c="tab:orange", marker="x", label="fake")
        ax.set_title(label, fontsize=10)
        ax.set_xlim(extent[:2])
        ax.set_ylim(extent[2:])
    if grad_norms.min() < 1.0 < grad_norms.max():
        right.contour(xs, ys, grad_norms, levels=[1.0], colors="white", linestyles="dashed")
    left.legend(loc="upper right", fontsize=8)
    return fig


def snapshot(
    runs: Mapping[str, str | Path],
    *,
    layout: Mapping[str, Mapping[str, list]] | None = None,
    images: Sequence[str] = (SALIENCY, CRITIC_LANDSCAPE),
) -> Figure:
    """A static picture of what TensorBoard shows for ``runs`` (name -> run directory).

    One panel per chart of the custom-scalars ``layout`` (default :func:`custom_scalars_layout`),
    each run's matching scalar tags drawn against the step, then each run's latest image of every
    tag in ``images``. For reports and READMEs where no browser is at hand; it reads the event
    files exactly as TensorBoard does (the whole run directory).
    """
    accumulators = {name: _load(path) for name, path in runs.items()}
    charts = [
        (title, regexes)
        for category in (layout or custom_scalars_layout()).values()
        for title, (_, regexes) in category.items()
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
