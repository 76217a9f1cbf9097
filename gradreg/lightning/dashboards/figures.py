r"""The dashboards' figures: saliency maps, grids of generated samples, a critic's landscape, and
their titles (step and λ).

The figures are drawn on :class:`matplotlib.figure.Figure` objects (Agg, no pyplot state), so they
render headless and in threads. TensorBoard shows an image scaled to its card (about 280 px wide
at the default size), so each figure is one near-square panel with large type, and a colour scale
that stays fixed over training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure


def figure_title(step: int, weights: Mapping[str, float]) -> str:
    """``step 120 · λ = 0.1`` (one penalty) or ``step 120 · λ r1 = 10, r2 = 1``; no λ without
    penalties."""
    if not weights:
        return f"step {step}"
    if len(weights) == 1:
        return f"step {step} · λ = {next(iter(weights.values())):.3g}"
    listed = ", ".join(f"{name.rsplit('.', 1)[-1]} = {value:.3g}"
                       for name, value in weights.items())
    return f"step {step} · λ {listed}"


# type sizes (points) of the figures: at TensorBoard's default card width an image is shown at
# about half its size, so labels are drawn at twice the usual size
TITLE, LABEL, TICK = 18, 16, 13
NUMBER = 24  # a number read off a panel (a saliency map's norm)


def saliency_figure(
    images: np.ndarray,
    saliency: np.ndarray,
    labels: Sequence[int] | None = None,
    *,
    vmax: float | None = None,
    scale: str = "",
    title: str = "",
    columns: int = 4,
) -> Figure:
    r"""Inputs over :math:`\lvert\nabla_{x_i}\ell_i\rvert`: each sample's input, its map under it.

    ``images``: ``[N, H, W]`` (gray) or ``[N, H, W, 3]`` in [0, 1]; ``saliency``: ``[N, H, W]``,
    >= 0, drawn on one colour scale ``[0, vmax]`` (default: the largest value shown; a caller
    that keeps ``vmax`` fixed over training and across runs makes the frames comparable), values
    above it at the top colour (the colour bar's arrow); ``scale`` says on the colour bar where
    ``vmax`` comes from. Under each map, in large type, is the sample's
    :math:`\lVert\nabla_{x_i}\ell_i\rVert_2`; ``columns`` samples per row.
    """
    n = len(saliency)
    columns = min(columns, n)
    rows = -(-n // columns)
    vmax = float(saliency.max()) if vmax is None else vmax
    fig = Figure(figsize=(1.55 * columns + 1.8, 3.9 * rows + 0.7), dpi=100)
    # per row of samples: inputs, maps, a gap for the norms
    grid = fig.add_gridspec(3 * rows - 1, columns + 1, width_ratios=[1] * columns + [0.12],
                            height_ratios=([1, 1, 0.6] * rows)[:-1], left=0.02, right=0.8,
                            top=1 - 0.8 / fig.get_figheight(), bottom=0.09, hspace=0.12,
                            wspace=0.08)
    norms = np.sqrt((saliency.reshape(n, -1) ** 2).sum(1))
    shown = None
    for k in range(n):
        row, col = divmod(k, columns)
        top, bottom = fig.add_subplot(grid[3 * row, col]), fig.add_subplot(grid[3 * row + 1, col])
        top.imshow(images[k], cmap="gray_r" if images.ndim == 3 else None, vmin=0, vmax=1)
        shown = bottom.imshow(saliency[k], cmap="magma", vmin=0, vmax=vmax)
        top.set_title(f"y={labels[k]}" if labels is not None else "", fontsize=LABEL)
        bottom.set_xlabel(f"{norms[k]:.2g}", fontsize=NUMBER, labelpad=2, fontweight="bold")
        for ax in (top, bottom):
            ax.set_xticks([])
            ax.set_yticks([])
    bar = fig.colorbar(shown, cax=fig.add_subplot(grid[:, columns]), extend="max")
    bar.ax.tick_params(labelsize=TICK)
    bar.set_label(r"$|\nabla_x \ell|$" + (f", {scale}" if scale else "")
                  + r"; under each map $\|\nabla_x \ell\|$", fontsize=LABEL)
    fig.suptitle(title, fontsize=TITLE)
    return fig


def samples_figure(images: np.ndarray, *, title: str = "", columns: int = 8) -> Figure:
    """Generated images in a grid with gaps between them, under ``title``.

    ``images``: ``[N, H, W]`` (gray) or ``[N, H, W, 3]`` in [0, 1], drawn pixel for pixel
    (nearest neighbour) on a white page, ``columns`` per row."""
    n = len(images)
    columns = min(columns, n)
    rows = -(-n // columns)
    fig = Figure(figsize=(0.9 * columns, 0.9 * rows + 0.6), dpi=100)
    grid = fig.add_gridspec(rows, columns, left=0.01, right=0.99, bottom=0.01,
                            top=1 - 0.55 / fig.get_figheight(), wspace=0.08, hspace=0.08)
    for k in range(n):
        ax = fig.add_subplot(grid[divmod(k, columns)])
        ax.imshow(images[k], cmap="gray" if images.ndim == 3 else None, vmin=0, vmax=1,
                  interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title, fontsize=TITLE)
    return fig


def critic_landscape_figure(
    xs: np.ndarray,
    ys: np.ndarray,
    field: np.ndarray,
    real: np.ndarray,
    fake: np.ndarray,
    *,
    kind: str,
    vmin: float,
    vmax: float,
    title: str = "",
) -> Figure:
    r"""One field over the plane, the real and fake samples on it: the critic's scores
    :math:`D(x)` (``kind="score"``) or its gradient norm :math:`\lVert\nabla_x D(x)\rVert_2`
    (``kind="grad_norm"``, with the level 1, WGAN-GP's target, dashed where the field crosses it).

    ``xs``, ``ys``: the grid axes (``[W]``, ``[H]``); ``field``: ``[H, W]`` on that grid, drawn on
    the colour scale ``[vmin, vmax]`` (values beyond are drawn at its ends, and the colour bar
    gets an arrow at each end the field passes); ``real``, ``fake``: ``[N, 2]`` samples (dots and
    crosses; those outside the grid are cut off, and the legend counts the fakes outside).
    """
    if kind not in ("score", "grad_norm"):
        raise ValueError(f"kind must be 'score' or 'grad_norm', got {kind!r}")
    fig = Figure(figsize=(5.6, 5.0), dpi=100)
    fig.subplots_adjust(left=0.1, right=0.86, top=0.86, bottom=0.08)
    ax = fig.add_subplot()
    extent = (xs[0], xs[-1], ys[0], ys[-1])
    cmap, label = (("RdBu_r", "critic D(x)") if kind == "score"
                   else ("viridis", r"$\|\nabla_x D(x)\|$"))
    shown = ax.imshow(field, origin="lower", extent=extent, cmap=cmap, aspect="auto",
                      vmin=vmin, vmax=vmax)
    # arrows at the ends the field passes: values beyond are drawn at the end colour
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max",
              (True, True): "both"}[(bool(field.min() < vmin), bool(field.max() > vmax))]
    bar = fig.colorbar(shown, ax=ax, fraction=0.06, pad=0.02, extend=extend)
    bar.ax.tick_params(labelsize=TICK)
    outside = int(((fake[:, 0] < xs[0]) | (fake[:, 0] > xs[-1]) | (fake[:, 1] < ys[0])
                   | (fake[:, 1] > ys[-1])).sum())
    ax.scatter(real[:, 0], real[:, 1], s=10, c="black", label="real")
    ax.scatter(fake[:, 0], fake[:, 1], s=18, c="tab:orange", marker="x",
               label=f"fake ({outside} outside)" if outside else "fake")
    if kind == "grad_norm" and field.min() < 1.0 < field.max():
        ax.contour(xs, ys, field, levels=[1.0], colors="white", linestyles="dashed")
    ax.set_xlim(extent[:2])
    ax.set_ylim(extent[2:])
    ax.tick_params(labelsize=TICK)
    ax.legend(loc="upper right", fontsize=TICK, markerscale=1.5)
    fig.suptitle(f"{label}\n{title}", fontsize=TITLE)
    return fig

