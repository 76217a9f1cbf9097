"""The validation curves of a sweep: each outcome metric over training, every run, coloured by λ.

TensorBoard's scalar charts choose their ranges in the browser (with "ignore outliers in chart
scaling", on by default, a run's highest or lowest values can fall outside them), smooth the
lines, and name a line's run only in a tooltip; the runs of a sweep's several λ look alike
there. This figure (logged to the sweep's summary run as ``Sweep/validation_curves``, beside the
metric-vs-λ figure where TensorBoard opens, and saved as ``validation_curves.png``) draws what
each job logged of the validation counterpart of each outcome metric
(:func:`~gradreg.app.sweeps.results.selection_metric`) against the training step, as logged:

* one colour per setting: the baseline (``penalty=none``) grey and dashed, the penalized
  settings from a sequential colour map in the order of λ (no two settings share a colour);
  each seed a line of its setting's colour, each run's last value a dot;
* one legend for all panels, naming each setting by its λ (and its other swept overrides); a
  search of more than :data:`MAX_LEGEND` settings (each trial its own λ and learning rate)
  colours each run by its λ on a log scale instead, read on a colour bar;
* each panel's vertical axis spans every value drawn (:func:`value_range`), unsmoothed.

The values are read from the jobs' TensorBoard event files (a job without them draws nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Colormap, ListedColormap, LogNorm
from matplotlib.figure import Figure

from .figure import BASELINE_COLOUR, panel_grid, shared_legend
from .results import Job, Setting, logged_metrics, outcome_metrics, selection_metric, settings

#: the part of the sequential colour map the settings take (its lightest end is hard to see)
COLOUR_SPAN = (0.0, 0.85)
#: the margin around the values of a panel, as a share of their range
MARGIN = 0.06
#: the most penalized settings named in a legend; more are coloured by λ with a colour bar
MAX_LEGEND = 10
#: the sequential colour map of the penalized settings
COLOUR_MAP = "viridis"

Curve = list[tuple[int, float]]


def read_curves(folder: Path, tags: Sequence[str]) -> dict[str, Curve]:
    """tag -> ``[(step, value), ...]`` of the scalars ``tags`` in the event files of ``folder``
    (its own, not those of sub-folders), in step order; the tags it did not log are left out."""
    if not any(folder.glob("events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(
        str(folder), size_guidance={event_accumulator.SCALARS: 0}).Reload()
    logged = set(accumulator.Tags()["scalars"])
    return {tag: sorted((event.step, event.value) for event in accumulator.Scalars(tag))
            for tag in tags if tag in logged}


def curve_metrics(jobs: Sequence[Job], optimized: str | None = None) -> list[str]:
    """The validation metrics drawn: the one choosing each outcome metric, in the outcome
    metrics' order (the optimized one first), each once."""
    logged = logged_metrics(jobs)
    chosen = (selection_metric(metric, logged) for metric in outcome_metrics(jobs, optimized))
    return list(dict.fromkeys(metric for metric in chosen if metric is not None))


def setting_label(setting: Setting) -> str:
    """``none (λ = 0)``, ``double_backprop λ = 0.1``, ``r1 λ = 10 model.optimizer.lr=0.001``."""
    head = ("none (λ = 0)" if setting.is_baseline
            else f"{setting.penalty} λ = {setting.weight:.3g}")
    return " ".join([head, *(f"{key}={value}" for key, value in setting.others)])


def weight_scale(rows: Sequence[Setting]) -> LogNorm | None:
    """The log scale of λ that colours the runs of more than :data:`MAX_LEGEND` penalized
    settings (λ > 0); None for fewer (each setting its own colour and legend entry)."""
    weights = [setting.weight for setting in rows if not setting.is_baseline and setting.weight > 0]
    if len(weights) <= MAX_LEGEND:
        return None
    return LogNorm(min(weights), max(weights) if max(weights) > min(weights) else min(weights) * 10)


def colour_map() -> Colormap:
    """:data:`COLOUR_MAP` over :data:`COLOUR_SPAN`."""
    return ListedColormap(colormaps[COLOUR_MAP](np.linspace(*COLOUR_SPAN, 256)))


def setting_colours(rows: Sequence[Setting], scale: LogNorm | None = None
                    ) -> dict[int, str | tuple]:
    """index in ``rows`` -> colour: grey for a baseline, else evenly spaced along
    :func:`colour_map` in the settings' order (by penalty, then λ), or where its λ falls on
    ``scale`` (:func:`weight_scale`)."""
    penalized = [k for k, setting in enumerate(rows) if not setting.is_baseline]
    if scale is None:
        shades = np.linspace(0, 1, max(len(penalized), 1))
    else:
        shades = [float(np.clip(scale(max(rows[k].weight, scale.vmin)), 0, 1))
                  for k in penalized]
    colours: dict[int, str | tuple] = {k: BASELINE_COLOUR for k, s in enumerate(rows)
                                       if s.is_baseline}
    colours.update({k: colour_map()(shade) for k, shade in zip(penalized, shades, strict=True)})
    return colours


def value_range(values: Sequence[float]) -> tuple[float, float]:
    """The vertical limits of a panel: every value inside, :data:`MARGIN` of their range
    around them (of their size, or 0.01, where all are equal)."""
    low, high = float(min(values)), float(max(values))
    pad = MARGIN * (high - low) or MARGIN * abs(high) or 0.01
    return low - pad, high + pad


def validation_curves_figure(jobs: Sequence[Job], optimized: str | None = None,
                             title: str = "") -> Figure | None:
    """The figure (module docstring) of ``jobs``; None where no job's event files hold a metric
    to draw."""
    metrics = curve_metrics(jobs, optimized)
    rows = settings(jobs)
    curves = {id(job): read_curves(job.folder, metrics) for setting in rows
              for job in setting.jobs if job.folder is not None}
    metrics = [metric for metric in metrics if any(metric in c for c in curves.values())]
    if not metrics:
        return None
    scale = weight_scale(rows)
    colours = setting_colours(rows, scale)
    fig, axes = panel_grid(len(metrics), 3.4, 1.2, full_width=True)  # the legend's room
    for ax, metric in zip(axes, metrics, strict=True):
        drawn: list[float] = []
        for k, setting in enumerate(rows):
            style = "--" if setting.is_baseline else "-"
            for job in setting.jobs:
                curve = curves.get(id(job), {}).get(metric)
                if not curve:
                    continue
                steps, values = zip(*curve, strict=True)
                named = scale is None or setting.is_baseline  # else: the colour bar's
                ax.plot(steps, values, style, color=colours[k], linewidth=1.4,
                        label=setting_label(setting) if named else "_on the colour bar")
                ax.plot(steps[-1:], values[-1:], "o", color=colours[k], markersize=4)
                drawn += values
        ax.set_ylim(*value_range(drawn))
        ax.set_xlabel("training step")
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    shared_legend(fig, axes, 5)
    if scale is not None:
        fig.colorbar(ScalarMappable(scale, colour_map()), ax=axes.tolist(),
                     label="penalty weight λ (log scale)")
    seeds = len({job.seed for job in jobs})
    fig.suptitle("\n".join(line for line in (
        "validation metrics over training, every run: "
        + ("coloured by λ" if scale is not None else "one colour per setting"),
        title, f"{seeds} seed{'s' * (seeds != 1)}, a line each; dot: the last value; "
               "grey dashed: no penalty") if line))
    return fig
