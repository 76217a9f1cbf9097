"""``summary.md`` of a sweep: per outcome metric, each setting against the baseline.

One table per metric (:func:`~gradreg.app.sweep_results.outcome_metrics`: the test metrics, the
optimized one first), one row per setting (:mod:`gradreg.app.sweep_results`): the penalty, its
effective λ (0 for ``none``, listed once), the other swept overrides, the runs that finished, the
mean ± sample standard deviation over seeds and the difference from the baseline paired by seed
± its standard error. The best setting of a metric whose direction is known (:func:`better`) is
in bold only where its difference from the baseline exceeds the noise (``|Δ| > 2·SE``) in the
better direction; a sweep without ``penalty=none`` runs has no differences and no bold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .sweep_results import Job, Setting, difference, outcome_metrics, settings

#: metrics where a larger value is better (name contains one of these) and where a smaller is
HIGHER_IS_BETTER = ("acc", "modes", "high_quality")
LOWER_IS_BETTER = ("loss", "energy_distance", "kl", "input_grad_norm")

EXPLANATION = (
    "Per metric, one row per setting: mean ± SD over its seeds (SD: the sample standard "
    "deviation, n − 1; the mean rounded to the SD's second significant digit), and Δ, its "
    "difference from the baseline (penalty=none, λ = 0) paired by seed: the mean of the "
    "per-seed differences ± its standard error SE = SD(differences) / √n. A difference "
    "exceeds the noise where |Δ| > 2·SE; the best setting of a metric is in bold only where "
    "its Δ exceeds the noise in the better direction ((max): larger is better, (min): "
    "smaller).")


def better(metric: str, optimized: str | None = None, direction: str | None = None
           ) -> str | None:
    """``"max"`` or ``"min"``: which value of ``metric`` is best (the sweeper's ``direction``
    for the optimized metric, else read off its name); None where the name does not say."""
    if metric == optimized and direction in ("maximize", "minimize"):
        return direction[:3]
    name = metric.rsplit("/", 1)[-1]
    if any(word in name for word in LOWER_IS_BETTER):
        return "min"
    if any(word in name for word in HIGHER_IS_BETTER):
        return "max"
    return None


def estimate(value: float, spread: float | None, sign: bool = False) -> str:
    """``0.620 ± 0.020``, ``+0.120 ± 0.012``: ``value`` rounded to the decimals of ``spread``'s
    two significant digits (4 significant digits without a spread, ``7 ± 0`` where it is 0);
    a leading ``+`` or ``-`` with ``sign``."""
    plus = "+" if sign else ""
    if spread is None:
        return f"{value:{plus}.4g}"
    if spread == 0:
        return f"{value:{plus}.4g} ± 0"
    decimals = max(0, 1 - math.floor(math.log10(spread)))
    return f"{round(value, decimals) + 0.0:{plus}.{decimals}f} ± {spread:.{decimals}f}"


def best_setting(rows: Sequence[Setting], metric: str, rule: str | None
                 ) -> Setting | None:
    """The setting with the best mean of ``metric`` among the non-baseline ones, where its
    difference from its baseline exceeds the noise in the better direction; else None."""
    if rule is None:
        return None
    candidates = [(s, s.spread(metric)) for s in rows if not s.is_baseline]
    candidates = [(s, spread) for s, spread in candidates if spread is not None]
    if not candidates:
        return None
    pick = max if rule == "max" else min
    best, _ = pick(candidates, key=lambda item: item[1].mean)
    delta = difference(best, rows, metric)
    if delta is None or not delta.exceeds_noise or (delta.mean > 0) != (rule == "max"):
        return None
    return best


def metric_table(rows: Sequence[Setting], metric: str, rule: str | None) -> str:
    """The Markdown table of one metric (module docstring)."""
    others = [key for key, _ in rows[0].others] if rows else []
    header = ["penalty", "λ", *others, "runs", "mean ± SD", "Δ vs baseline ± SE"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    best = best_setting(rows, metric, rule)
    for setting in rows:
        values = setting.spread(metric)
        cell = "" if values is None else estimate(values.mean, values.sd)
        delta = difference(setting, rows, metric)
        change = "" if delta is None else estimate(delta.mean, delta.se, sign=True)
        if setting is best:
            cell, change = f"**{cell}**", f"**{change}**"
        weight = "0" if setting.is_baseline else f"{setting.weight:.4g}"
        runs = f"{len(setting.finished)}/{len(setting.jobs)}"
        lines.append("| " + " | ".join([setting.penalty, weight,
                                         *(value for _, value in setting.others), runs, cell,
                                         change]) + " |")
    return "\n".join(lines)


def summary_markdown(jobs: Sequence[Job], optimized: str | None = None,
                     direction: str | None = None) -> str:
    """The body of ``summary.md`` (after its title): :data:`EXPLANATION`, then a section per
    outcome metric, ``## <metric> (max)``, with its :func:`metric_table`; ``""`` where no job
    finished."""
    rows = settings(jobs)
    metrics = outcome_metrics(jobs, optimized)
    if not metrics:
        return ""
    seeds = sorted({job.seed for job in jobs}, key=lambda seed: (len(seed), seed))
    baseline = ("no penalty=none runs: no differences" if not any(s.is_baseline for s in rows)
                else "baseline: penalty=none (λ = 0)")
    parts = [EXPLANATION, f"Seeds {', '.join(seeds)}; {baseline}."]
    for metric in metrics:
        rule = better(metric, optimized, direction)
        parts.append(f"## {metric} ({rule or '?'})\n\n{metric_table(rows, metric, rule)}")
    return "\n\n".join(parts) + "\n"
