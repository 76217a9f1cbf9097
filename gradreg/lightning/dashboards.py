r"""TensorBoard dashboards for gradient penalties: one tag scheme, the custom-scalars layout, the
figures.

One tag scheme for classifiers and GANs (what the callbacks in :mod:`gradreg.lightning.callbacks`
write; ``<owner>`` is the submodule an optimizer updates, ``critic`` or ``generator``, and is left
out when there is one optimizer; ``<path>`` a penalty's module path, ``penalties.wgan_gp``):

=========================================  ========================================================
``loss/total[/<owner>]``                   the loss backpropagated before an optimizer step: task
                                           loss + the weighted penalties
``grad_norm/total[/<owner>]``              :math:`\lVert\partial L/\partial\theta\rVert_p` over the
                                           optimizer's parameters
``param_grad/<layer>`` (histogram)         the entries of :math:`\partial L/\partial\theta` of one
                                           layer's weights (parameters of 2+ dimensions)
``param_grad_bias/<layer>`` (histogram)    the same of its 1-D parameters (biases)
``input_grad/norm_mean|max``, histogram    per-sample :math:`\lVert\nabla_{x_i}\ell_i\rVert_p`:
``input_grad/norm``                        batch mean, max and distribution
``penalty/unweighted/<path>``              the penalty :math:`P` of its last call
``penalty/weighted/<path>``                :math:`\lambda \cdot \text{every} \cdot \text{gain}
                                           \cdot P`: the term the loss got at that call
``penalty/weight/<path>``                  :math:`\lambda`, at every logged step
``grad_split/task|penalty/<layer>``         :math:`\lVert\partial L_\text{task}/\partial
                                           \theta_l\rVert`, :math:`\lVert\partial \sum_k
                                           \lambda_k P_k/\partial\theta_l\rVert` per layer
``grad_split/penalty_share|cosine/<layer>``  the penalty's share of those norms, the cosine
                                           between the two parts
``interpolates/grad_norm_mean|target``,    :math:`\lVert\nabla D(\hat x)\rVert_2` at WGAN-GP's
histogram ``interpolates/grad_norm``       interpolates: mean, the penalty's target (1),
                                           distribution
``saliency``                               image: inputs over :math:`\lvert\nabla_x\ell\rvert`
``critic_landscape/score|grad_norm``       images: critic scores, :math:`\lVert\nabla_x D\rVert`
``samples``                                image: a grid of generated images of fixed latents,
                                           with the step and λ
``graph/autograd[/<owner>]``               image: the backward graph of the penalized loss
``autograd_graph/text|dot``                text: the same graphs, to search and to paste
=========================================  ========================================================

The modules' own ``self.log`` tags (``train/loss``, ``train/critic/adversarial``, ``val/acc``, ...)
are left as they are; the HParams table takes its metrics from them. One quantity has one tag:
the modules show their total loss and weighted penalties in the progress bar only, as
``loss/total`` and ``penalty/weighted/<path>`` are the same numbers. TensorBoard's Time Series tab
shows tag groups (the part before the first ``/``) in alphabetical order, the first open: the
names above put the scalars of ``grad_norm`` (or a GAN's critic landscape) first, and
:class:`TensorBoardLogger` leaves out the ``epoch`` scalar that Lightning adds to every step.

The figures are drawn on :class:`matplotlib.figure.Figure` objects (Agg, no pyplot state), so they
render headless and in threads. TensorBoard shows an image scaled to its card (about 280 px wide
at the default size), so each figure is one near-square panel with large type, and a colour scale
that stays fixed over training. :func:`snapshot` renders a logged run as one static picture.
"""

from __future__ import annotations

import io
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from matplotlib.figure import Figure
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

__all__ = [
    "AUTOGRAD_GRAPH",
    "CHARTS",
    "CRITIC_LANDSCAPE",
    "GRAD_NORM",
    "GRAD_SPLIT",
    "GRAPH_PICTURE",
    "INPUT_GRAD",
    "INTERPOLATES",
    "LOSS_TOTAL",
    "OUTCOMES",
    "PARAM_GRAD",
    "PARAM_GRAD_BIAS",
    "PENALTY_UNWEIGHTED",
    "PENALTY_WEIGHT",
    "PENALTY_WEIGHTED",
    "SALIENCY",
    "SAMPLES",
    "TASK_LOSS",
    "TensorBoardLogger",
    "critic_landscape_figure",
    "custom_scalars_layout",
    "figure_title",
    "saliency_figure",
    "samples_figure",
    "snapshot",
]

LOSS_TOTAL = "loss/total"
GRAD_NORM = "grad_norm"
PARAM_GRAD = "param_grad"
PARAM_GRAD_BIAS = "param_grad_bias"
INPUT_GRAD = "input_grad"
PENALTY_UNWEIGHTED = "penalty/unweighted"
PENALTY_WEIGHTED = "penalty/weighted"
PENALTY_WEIGHT = "penalty/weight"
INTERPOLATES = "interpolates"
SALIENCY = "saliency"
CRITIC_LANDSCAPE = "critic_landscape"
SAMPLES = "samples"
AUTOGRAD_GRAPH = "autograd_graph"  # the text; the picture is GRAPH_PICTURE
GRAPH_PICTURE = "graph/autograd"
GRAD_SPLIT = "grad_split"

CATEGORY = "gradreg"
# the end of an outcome chart's title: TensorBoard's default smoothing (0.6) and "ignore outliers
# in chart scaling" can hide a run's first and final values (a GAN's energy distance falls
# steeply), which the HParams table lists as they are
FINAL = " (validation; final values: HParams tab, smoothing and 'ignore outliers' hide them)"
# the modules' training task losses: the classifier's (and a user's) train/loss, the GAN's
# adversarial terms train/critic/adversarial and train/generator/adversarial
TASK_LOSS = (r"train/loss$", r"train/[^/]+/adversarial$")

# chart key -> (title, regexes); a regex matches a tag from its start (re.match). "task_loss"
# takes the caller's regexes; "penalty_unweighted" becomes one chart per penalty where the caller
# names them (penalties of different kinds have different scales), "grad_split" one chart per
# layer where the caller names the layers. The order is the layout's: the outcome first (what a
# sweep is judged by, one metric per chart, so that a sweep's many runs stay readable), then the
# terms of the loss, then the gradients.
CHARTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "accuracy": (f"outcome: val/acc, clean accuracy{FINAL}", (r"val/acc$",)),
    "accuracy_fgsm": (f"outcome: val/acc_fgsm, accuracy under FGSM{FINAL}", (r"val/acc_fgsm$",)),
    "accuracy_pgd": (f"outcome: val/acc_pgd, accuracy under PGD{FINAL}", (r"val/acc_pgd$",)),
    "energy_distance": (f"outcome: val/energy_distance to held-out samples{FINAL}",
                        (r"val/energy_distance$",)),
    "feature_energy_distance": (f"outcome: val/feature_energy_distance{FINAL}",
                                (r"val/feature_energy_distance$",)),
    "modes": (f"outcome: val/modes covered{FINAL}", (r"val/modes$",)),
    "task_loss": ("task loss (train)", TASK_LOSS),
    "penalty_weighted": ("penalties, weighted: λ·P as added to the loss",
                         (rf"{PENALTY_WEIGHTED}/.*",)),
    "penalty_unweighted": ("penalties, unweighted P", (rf"{PENALTY_UNWEIGHTED}/.*",)),
    "grad_split": ("penalty's share of the parameter gradient per layer, "
                   "‖g_pen‖ / (‖g_task‖ + ‖g_pen‖)", (rf"{GRAD_SPLIT}/penalty_share/.*",)),
    "grad_norm": ("parameter gradient norm ‖∂L/∂θ‖ per optimizer", (rf"{GRAD_NORM}/total(/.*)?$",)),
    "input_grad": ("input gradient norm ‖∇x ℓ‖: batch mean and max",
                   (rf"{INPUT_GRAD}/norm_(mean|max)$",)),
    "interpolates": ("critic gradient norm ‖∇D(x̂)‖ at interpolates: mean and target",
                     (rf"{INTERPOLATES}/grad_norm_(mean|target)$",)),
    "loss_total": ("loss + penalty (train): what is backpropagated", (rf"{LOSS_TOTAL}(/.*)?$",)),
    "penalty_weight": ("penalty weights λ", (rf"{PENALTY_WEIGHT}/.*",)),
}
#: the outcome charts of :data:`CHARTS` (``CustomScalarsLayout(outcome=...)``), one metric each
OUTCOMES = ("accuracy", "accuracy_fgsm", "accuracy_pgd", "energy_distance",
            "feature_energy_distance", "modes")


class TensorBoardLogger(LightningTensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` without the ``epoch`` scalar that Lightning adds to the
    metrics of every logged step (the chart TensorBoard's Time Series tab would open on, which
    says nothing the step axis does not)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics({tag: value for tag, value in metrics.items() if tag != "epoch"},
                            step)


def custom_scalars_layout(
    loss: Sequence[str] = TASK_LOSS, charts: Iterable[str] | None = None,
    category: str = CATEGORY, penalties: Sequence[str] = (), layers: Sequence[str] = (),
) -> dict[str, dict[str, list]]:
    """The layout for ``SummaryWriter.add_custom_scalars``: the ``charts`` of :data:`CHARTS`.

    Each chart is ``["Multiline", [regex, ...]]``; TensorBoard draws every scalar tag that a regex
    matches from its start (``re.match``). ``loss`` are the regexes of the training task-loss tags
    (the module's own ``self.log`` names); ``charts`` the keys of :data:`CHARTS` to include (all
    by default), drawn in :data:`CHARTS`' order; ``penalties`` the module paths of the penalties
    (``penalties.r1``): "penalties, unweighted P" is then one chart per penalty, each on its own
    scale; ``layers`` the layers of :class:`~gradreg.lightning.callbacks.GradientSplit`: the
    gradient split is then one chart per layer of ``‖g_task‖`` and ``‖g_pen‖`` (each run's two
    lines on one chart of its own, instead of every layer of every run in one). TensorBoard
    merges the layouts of the runs of a log folder, keeping one copy of equal charts: runs of
    both module kinds with the default ``loss`` get one chart of each title.
    """
    keys = set(CHARTS if charts is None else charts)
    unknown = sorted(keys - set(CHARTS))
    if unknown:
        raise ValueError(f"unknown charts {unknown}; the charts are {list(CHARTS)}")
    layout: dict[str, list] = {}
    for key, (title, regexes) in CHARTS.items():
        if key not in keys:
            continue
        if key == "penalty_unweighted" and penalties:
            for path in penalties:
                layout[f"penalty {path.rsplit('.', 1)[-1]}, unweighted P"] = [
                    "Multiline", [rf"{PENALTY_UNWEIGHTED}/{re.escape(path)}$"]]
            continue
        if key == "grad_split" and layers:
            for layer in layers:
                layout[f"gradient of layer {layer}: ‖∂L_task/∂θ‖ and ‖∂(λ·P)/∂θ‖"] = [
                    "Multiline", [rf"{GRAD_SPLIT}/(task|penalty)/{re.escape(layer)}$"]]
            continue
        layout[title] = ["Multiline", list(loss if key == "task_loss" else regexes)]
    return {category: layout}


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
