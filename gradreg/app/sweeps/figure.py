"""The metric-vs-λ figure of a sweep: each outcome metric against the penalty weight.

One panel per outcome metric (:func:`~gradreg.app.sweeps.results.outcome_metrics`), λ on a log
axis; per penalty (and setting of the other swept overrides) one colour, a line through the mean
over seeds at each λ and a band of ± one sample standard deviation (a search, whose every
trial has its own λ and other values: one colour per penalty, each trial a point, no line);
the baseline (``penalty=none``, λ = 0, which a log axis cannot place) as a grey horizontal line
at its mean with a band of ± its SD across the whole axis. One legend for all panels; the title's
first line the setting chosen for the first metric (:func:`~gradreg.app.sweeps.table.headline`).
Drawn on a :class:`matplotlib.figure.Figure` (Agg, no pyplot state).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from .results import Job, Setting, outcome_metrics, settings
from .table import headline

COLUMNS = 3
#: a panel's width in inches (100 pixels each): three panels, 1,170 pixels, fit TensorBoard's
#: image cards at their own size beside its side bar in a 1600-pixel window
PANEL_WIDTH = 3.9
#: a sweep of at most this many λ values gets them as the ticks of the λ axis
MAX_TICKS = 8
BASELINE_COLOUR = "0.35"


def panel_grid(count: int, panel_height: float, margin: float, *, full_width: bool = False
               ) -> tuple[Figure, np.ndarray]:
    """A figure of ``count`` panels in rows of at most :data:`COLUMNS` (``panel_height`` inches
    each, ``margin`` more for the title and the legend; ``full_width``: :data:`COLUMNS` panels'
    width however many, the room of a wide legend) and its ``count`` axes, the grid's others
    hidden."""
    columns = min(COLUMNS, count)
    rows = -(-count // columns)
    fig = Figure(figsize=(PANEL_WIDTH * (COLUMNS if full_width else columns),
                          panel_height * rows + margin), dpi=100, layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]


def shared_legend(fig: Figure, axes: np.ndarray, columns: int) -> None:
    """One legend below the panels: each label drawn in any of ``axes`` once, in rows of at
    most ``columns``; none where nothing is labelled."""
    labels: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labels.setdefault(label, handle)
    if labels:
        fig.legend(labels.values(), labels.keys(), loc="outside lower center",
                   ncols=min(columns, len(labels)))


def series_name(setting: Setting) -> str:
    """``double_backprop``, ``r1 model.optimizer.lr=0.001``: a series' legend entry."""
    return " ".join([setting.penalty, *(f"{key}={value}" for key, value in setting.others)])


def metric_vs_weight_figure(jobs: Sequence[Job], optimized: str | None = None,
                            title: str = "", direction: str | None = None) -> Figure | None:
    """The figure (module docstring) of ``jobs``, its title first saying which setting was
    chosen (:func:`~gradreg.app.sweeps.table.headline`); None where no finished job has a
    penalty with λ > 0 (nothing to put on a log axis)."""
    rows = settings(jobs)
    penalized = [s for s in rows if not s.is_baseline and s.weight > 0 and s.finished]
    metrics = outcome_metrics(jobs, optimized)
    if not penalized or not metrics:
        return None
    series: dict[str, list[Setting]] = {}
    for setting in penalized:
        series.setdefault(series_name(setting), []).append(setting)
    # a search (every trial its own λ and lr): one series per penalty, its trials as points
    scattered = len(series) > 1 and all(len(members) == 1 for members in series.values())
    if scattered:
        series = {}
        for setting in penalized:
            series.setdefault(setting.penalty, []).append(setting)
    colours = {name: f"C{k % 10}" for k, name in enumerate(series)}
    swept = sorted({setting.weight for setting in penalized})
    fig, axes = panel_grid(len(metrics), 3.6, 0.9)
    for ax, metric in zip(axes, metrics, strict=True):
        for baseline in (s for s in rows if s.is_baseline):
            values = baseline.spread(metric)
            if values is None:
                continue
            label = " ".join(["none (λ = 0)", *(f"{k}={v}" for k, v in baseline.others)])
            ax.axhline(values.mean, color=BASELINE_COLOUR, linestyle="--", label=label)
            if values.sd is not None:
                ax.axhspan(values.mean - values.sd, values.mean + values.sd,
                           color=BASELINE_COLOUR, alpha=0.15, linewidth=0)
        for name, members in series.items():
            points = [(s.weight, s.spread(metric)) for s in members]
            points = sorted((w, v) for w, v in points if v is not None)
            if not points:
                continue
            weights = np.array([w for w, _ in points])
            means = np.array([v.mean for _, v in points])
            sds = np.array([v.sd if v.sd is not None else 0.0 for _, v in points])
            if scattered:
                ax.errorbar(weights, means, yerr=sds, fmt="o", color=colours[name], label=name)
                continue
            ax.plot(weights, means, marker="o", color=colours[name], label=name)
            ax.fill_between(weights, means - sds, means + sds, color=colours[name], alpha=0.2,
                            linewidth=0)
        ax.set_xscale("log")
        if len(swept) <= MAX_TICKS:  # a grid: its own λ values as the ticks
            ax.set_xticks(swept, [f"{weight:g}" for weight in swept])
            ax.minorticks_off()
        ax.set_xlabel("penalty weight λ")
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    shared_legend(fig, axes, 4)
    seeds = len({job.seed for job in jobs})
    answer = headline(jobs, optimized, direction)
    fig.suptitle("\n".join(line for line in (
        answer, title, f"mean ± SD over {seeds} seed{'s' * (seeds != 1)}; grey dashed: no penalty")
        if line))
    return fig
