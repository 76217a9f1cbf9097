"""``summary.md`` of a sweep: per outcome metric, the setting chosen on the validation split and
how it does on the test split, against the baseline and against the runner-up.

One section per outcome metric (:func:`~gradreg.app.sweeps.results.outcome_metrics`: the test
metrics, the optimized one first). The setting is **chosen on the validation split**
(:func:`~gradreg.app.sweeps.results.selection_metric`: ``val/acc_pgd`` chooses for
``test/acc_pgd``; choosing on the test metric itself would select on the test set): the best
validation mean, the **runner-up** the second best. A line in words says what was chosen and
its test difference from the baseline and from the runner-up, paired by seed, with its 95%
confidence interval (:mod:`gradreg.app.sweeps.results`) and whether it exceeds the noise; with
one seed, that no spread is known. Settings tied on validation (equal as shown) are named
together and none is chosen.

Then a table, one row per setting: the penalty, its effective λ (0 for ``none``, listed once),
the other swept overrides, its seeds that finished (each seed counted once), the validation
and test means ± SD over seeds, and the test difference from the baseline ± the half-width of
its 95% interval. The chosen setting's row is in bold only where its test difference from the
baseline exceeds the noise in the better direction (:func:`better`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .results import (
    Difference,
    Job,
    Setting,
    compare,
    difference,
    logged_metrics,
    outcome_metrics,
    selection_metric,
    settings,
    t_quantile,
)

#: metrics where a larger value is better (name contains one of these) and where a smaller is
HIGHER_IS_BETTER = ("acc", "modes", "high_quality")
LOWER_IS_BETTER = ("loss", "energy_distance", "kl", "input_grad_norm")

EXPLANATION = (
    "Per metric, the setting is chosen on the validation split (its best mean there; the test "
    "split stays out of the choice) and reported on the test split. Each row: the seeds that "
    "finished, mean ± SD over them (SD: the sample standard deviation, n − 1; the mean rounded "
    "to the SD's second significant digit), and Δ, the test difference from the baseline "
    "(penalty=none, λ = 0) paired by seed: the mean of the per-seed differences ± the half-width "
    "of its 95% confidence interval, t(0.975, n − 1) · SD(differences) / √n over n seeds "
    "({quantiles}). A difference exceeds the noise where that interval excludes 0. The chosen "
    "setting is in bold only where its Δ exceeds the noise in the better direction ((max): larger "
    "is better, (min): smaller).")


def better(metric: str, optimized: str | None = None, direction: str | None = None
           ) -> str | None:
    """``"max"`` or ``"min"``: which value of ``metric`` is best (the sweeper's ``direction``
    for the optimized metric and its test counterpart, else read off its name); None where the
    name does not say."""
    if direction in ("maximize", "minimize") and optimized is not None and (
            metric == optimized or metric.split("/", 1)[-1] == optimized.split("/", 1)[-1]):
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


def cell(setting: Setting, metric: str | None) -> str:
    """``setting``'s mean ± SD of ``metric`` as the table shows it (``""`` where not logged)."""
    values = None if metric is None else setting.spread(metric)
    return "" if values is None else estimate(values.mean, values.sd)


def label(setting: Setting) -> str:
    """``double_backprop λ = 0.3``, ``none (λ = 0)``, with the other swept overrides."""
    name = "none (λ = 0)" if setting.is_baseline else f"{setting.penalty} λ = {setting.weight:.4g}"
    return " ".join([name, *(f"{key}={value}" for key, value in setting.others)])


def interval(delta: Difference) -> str:
    """``+0.120 (95% CI +0.070 to +0.170, 3 seeds)``; ``+0.120 (1 seed: no spread known)``."""
    if delta.half_width is None:
        return f"{delta.mean:+.4g} (1 seed: no spread known)"
    low, high = delta.mean - delta.half_width, delta.mean + delta.half_width
    decimals = max(0, 1 - math.floor(math.log10(delta.half_width))) if delta.half_width else 4
    return (f"{delta.mean:+.{decimals}f} (95% CI {low:+.{decimals}f} to {high:+.{decimals}f}, "
            f"{delta.n} seeds)")


def verdict(delta: Difference, rule: str | None) -> str:
    """Whether ``delta`` exceeds the noise, and in which direction."""
    if delta.half_width is None:
        return "not told from noise"
    if not delta.exceeds_noise:
        return "within the noise"
    if rule is None:
        return "beyond the noise"
    return "better beyond the noise" if (delta.mean > 0) == (rule == "max") else (
        "worse beyond the noise")


@dataclass(frozen=True)
class Choice:
    """The settings ranked on validation: the chosen one (None where the best are tied), the
    runner-up, and the settings tied for best."""

    chosen: Setting | None
    runner_up: Setting | None
    tied: tuple[Setting, ...]


def choose(rows: Sequence[Setting], selection: str | None, rule: str | None) -> Choice | None:
    """The best and second-best settings by their mean of ``selection`` (the direction
    ``rule``); None without a validation metric, a direction or a setting that logged it. The
    best are tied where their means are equal as the table shows them."""
    if selection is None or rule is None:
        return None
    ranked = [(s, s.spread(selection)) for s in rows]
    ranked = sorted(((s, v) for s, v in ranked if v is not None),
                    key=lambda item: item[1].mean, reverse=rule == "max")
    if not ranked:
        return None
    shown = [cell(s, selection) for s, _ in ranked]
    best = [s for (s, _), text in zip(ranked, shown, strict=True) if text == shown[0]]
    tied = tuple(s for s in rows if any(s is other for other in best))  # in the table's order
    runner_up = ranked[1][0] if len(ranked) > 1 else None
    return Choice(None if len(tied) > 1 else ranked[0][0], runner_up, tied)


def choice_line(rows: Sequence[Setting], metric: str, selection: str | None, rule: str | None,
                choice: Choice | None) -> str:
    """The sentence above a metric's table: what was chosen on validation and how it compares
    on ``metric`` with the baseline and the runner-up."""
    if selection is None:
        return (f"No validation counterpart of {metric} was logged: no setting is chosen "
                "(choosing on the test split would select on the test set).")
    if rule is None:
        return f"Whether {metric} is better larger or smaller is not known: no setting is chosen."
    if choice is None:
        return f"No setting logged {selection}: none is chosen."
    if choice.chosen is None:
        names = ", ".join(label(s) for s in choice.tied)
        return f"Tied on {selection} ({cell(choice.tied[0], selection)}): {names}; none is chosen."
    chosen = choice.chosen
    parts = [f"Chosen on {selection}: {label(chosen)}."]
    if metric != selection:
        parts.append(f"On {metric}:")
    else:
        parts.append(f"No test split: reported on {metric} too, which chose it (optimistic).")
    comparisons = []
    baseline = next((s for s in rows if s.is_baseline and s.others == chosen.others), None)
    if baseline is not None and baseline is not chosen:
        delta = compare(chosen, baseline, metric)
        if delta is not None:
            comparisons.append(f"against no penalty {interval(delta)}, {verdict(delta, rule)}")
    if choice.runner_up is not None:
        delta = compare(chosen, choice.runner_up, metric)
        if delta is not None:
            comparisons.append(f"against the runner-up on validation, {label(choice.runner_up)}, "
                               f"{interval(delta)}, {verdict(delta, rule)}")
    if comparisons:
        parts.append("; ".join(comparisons) + ".")
    if len(chosen.finished_seeds) < 2:
        parts.append("With one seed no spread is known: no difference can be told from the "
                     "noise (run seed=0,1,2).")
    return " ".join(parts)


def headline(jobs: Sequence[Job], optimized: str | None = None,
             direction: str | None = None) -> str | None:
    """The answer of a sweep in one line, for its first outcome metric:
    ``double_backprop λ = 0.3 chosen on val/acc_pgd; test/acc_pgd +0.175 (95% CI +0.097 to
    +0.254, 3 seeds) over no penalty``; None where no setting is chosen (no validation
    counterpart, no direction, a tie)."""
    metrics = outcome_metrics(jobs, optimized)
    if not metrics:
        return None
    rows = settings(jobs)
    metric = metrics[0]
    rule = better(metric, optimized, direction)
    selection = selection_metric(metric, logged_metrics(jobs))
    choice = choose(rows, selection, rule)
    if choice is None or choice.chosen is None:
        return None
    chosen = choice.chosen
    line = f"{label(chosen)} chosen on {selection}"
    baseline = next((s for s in rows if s.is_baseline and s.others == chosen.others), None)
    delta = None if baseline is None or baseline is chosen else compare(chosen, baseline, metric)
    if delta is not None:
        line += f"; {metric} {interval(delta)} over no penalty"
    return line


def metric_table(rows: Sequence[Setting], metric: str, selection: str | None,
                 chosen: Setting | None, rule: str | None) -> str:
    """The Markdown table of one metric (module docstring)."""
    others = [key for key, _ in rows[0].others] if rows else []
    columns = [selection] if selection is not None and selection != metric else []
    header = ["penalty", "λ", *others, "seeds", *columns, metric, "Δ vs baseline (95% CI)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for setting in rows:
        delta = difference(setting, rows, metric)
        change = "" if delta is None else estimate(delta.mean, delta.half_width, sign=True)
        cells = [cell(setting, name) for name in columns] + [cell(setting, metric), change]
        if setting is chosen and delta is not None and delta.exceeds_noise and rule is not None \
                and (delta.mean > 0) == (rule == "max"):
            cells = [f"**{text}**" if text else text for text in cells]
        weight = "0" if setting.is_baseline else f"{setting.weight:.4g}"
        seeds = f"{len(setting.finished_seeds)}/{len(setting.seeds)}"
        lines.append("| " + " | ".join([setting.penalty, weight,
                                         *(value for _, value in setting.others), seeds,
                                         *cells]) + " |")
    return "\n".join(lines)


def quantiles_in_words(seeds: int) -> str:
    """``t = 4.30 for 3 seeds``, with the common counts around ``seeds``."""
    counts = sorted({2, 3, 5, max(seeds, 2)})
    return ", ".join(f"t = {t_quantile(n):.2f} for {n} seeds" for n in counts)


def summary_markdown(jobs: Sequence[Job], optimized: str | None = None,
                     direction: str | None = None) -> str:
    """The body of ``summary.md`` (after its title): :data:`EXPLANATION`, then a section per
    outcome metric, ``## <metric> (max)``, with its :func:`choice_line` and
    :func:`metric_table`; ``""`` where no job finished."""
    rows = settings(jobs)
    metrics = outcome_metrics(jobs, optimized)
    if not metrics:
        return ""
    logged = logged_metrics(jobs)
    seeds = sorted({job.seed for job in jobs}, key=lambda seed: (len(seed), seed))
    baseline = ("no penalty=none runs: no differences" if not any(s.is_baseline for s in rows)
                else "baseline: penalty=none (λ = 0)")
    spread = "" if len(seeds) > 1 else " One seed: no spread is known, no difference can be " \
                                        "told from the noise."
    parts = [EXPLANATION.format(quantiles=quantiles_in_words(len(seeds))),
             f"Seeds {', '.join(seeds)}; {baseline}.{spread}"]
    for metric in metrics:
        rule = better(metric, optimized, direction)
        selection = selection_metric(metric, logged)
        choice = choose(rows, selection, rule)
        chosen = choice.chosen if choice is not None else None
        parts.append(f"## {metric} ({rule or '?'})\n\n"
                     f"{choice_line(rows, metric, selection, rule, choice)}\n\n"
                     f"{metric_table(rows, metric, selection, chosen, rule)}")
    return "\n\n".join(parts) + "\n"
