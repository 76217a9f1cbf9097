r"""What the jobs of a sweep measured, as settings against the baseline, paired by seed.

A job is one run of a sweep's folder: its penalty and **effective** weight :math:`\lambda` (from
its ``.hydra/config.yaml``: 0 for ``penalty=none``, whatever ``penalty.weight`` the command line
gave it), its seed, the other swept overrides (``.hydra/overrides.yaml``: those whose values
differ between the jobs, ``seed``, ``penalty`` and ``penalty.weight`` left out) and its
``metrics.json`` (None where it saved none: it failed, diverged or was pruned).

A **setting** is the jobs of one (penalty, λ, other overrides); the **baseline** of a setting is
the ``penalty=none`` setting with the same other overrides (one row however many weights the
command line gave ``none``; each seed counted once). Statistics, per metric, over seeds
:math:`s = 1..n`:

* a setting's value of seed :math:`s`, :math:`x_s`: the mean of its jobs with that seed (jobs of
  one setting and seed compute the same run);
* its mean :math:`\bar x` and sample standard deviation
  :math:`\mathrm{SD} = \sqrt{\sum_s (x_s - \bar x)^2 / (n - 1)}` (none for one seed);
* its difference from another setting :math:`b` (the baseline, or the runner-up), paired by seed
  over the seeds both have: :math:`d_s = x_s - b_s`, :math:`\bar d`, its standard error
  :math:`\mathrm{SE} = \mathrm{SD}(d) / \sqrt{n}` and the half-width of its 95% confidence
  interval, :math:`h = t_{0.975,\,n-1}\,\mathrm{SE}` (Student's t with :math:`n - 1` degrees of
  freedom: 12.71 for 2 seeds, 4.30 for 3, 2.78 for 5, 2.26 for 10); the difference **exceeds
  the noise** where the interval excludes 0, :math:`|\bar d| > h` (and :math:`n \ge 2`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf
from scipy import stats

from ..run_names import NO_PENALTY, effective_weight

#: overrides that a setting states in its own columns (penalty, λ) or pairs by (seed)
OWN_KEYS = ("penalty", "penalty.weight", "seed")
#: the penalty name of the baseline
BASELINE = NO_PENALTY


@dataclass(frozen=True)
class Job:
    """One run of a sweep (module docstring)."""

    penalty: str
    weight: float
    seed: str
    overrides: Mapping[str, str]
    metrics: Mapping[str, float] | None
    #: the job's folder (its event files: :mod:`gradreg.app.sweeps.curves`)
    folder: Path | None = None


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation (None for one value) of ``n`` per-seed values."""

    mean: float
    sd: float | None
    n: int


#: the confidence level of a difference's interval
CONFIDENCE = 0.95


def t_quantile(n: int) -> float:
    """:math:`t_{0.975,\\,n-1}`: the quantile of Student's t with ``n - 1`` degrees of freedom
    that a 95% interval of the mean of ``n`` values spans in standard errors (``n >= 2``)."""
    return float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1))


@dataclass(frozen=True)
class Difference:
    """Mean of the per-seed differences, its standard error and the half-width of its 95%
    confidence interval (both None for one seed), over ``n`` paired seeds."""

    mean: float
    se: float | None
    n: int

    @property
    def half_width(self) -> float | None:
        """:math:`h = t_{0.975,\\,n-1}\\,\\mathrm{SE}`; None for one seed."""
        return None if self.se is None else t_quantile(self.n) * self.se

    @property
    def exceeds_noise(self) -> bool:
        """Whether the 95% interval excludes 0, :math:`|\\bar d| > h` (two seeds or more)."""
        return self.se is not None and abs(self.mean) > self.half_width


@dataclass
class Setting:
    """The jobs of one (penalty, λ, other swept overrides)."""

    penalty: str
    weight: float
    others: tuple[tuple[str, str], ...]
    jobs: list[Job] = field(default_factory=list)

    @property
    def is_baseline(self) -> bool:
        return self.penalty == BASELINE

    @property
    def finished(self) -> list[Job]:
        return [job for job in self.jobs if job.metrics is not None]

    @property
    def seeds(self) -> list[str]:
        """The seeds of this setting's jobs, each once."""
        return list(dict.fromkeys(job.seed for job in self.jobs))

    @property
    def finished_seeds(self) -> list[str]:
        """The seeds with a finished job."""
        return list(dict.fromkeys(job.seed for job in self.finished))

    def per_seed(self, metric: str) -> dict[str, float]:
        """seed -> the mean of ``metric`` over this setting's finished jobs with that seed."""
        values: dict[str, list[float]] = {}
        for job in self.finished:
            if metric in job.metrics:
                values.setdefault(job.seed, []).append(float(job.metrics[metric]))
        return {seed: float(np.mean(seen)) for seed, seen in values.items()}

    def spread(self, metric: str) -> Spread | None:
        """Mean ± sample SD of :meth:`per_seed`; None where no job logged ``metric``."""
        return spread(list(self.per_seed(metric).values()))


def spread(values: Sequence[float]) -> Spread | None:
    """Mean and sample standard deviation (``ddof=1``) of ``values``; None where empty."""
    if not values:
        return None
    array = np.asarray(values, dtype=float)
    sd = float(array.std(ddof=1)) if len(array) > 1 else None
    return Spread(float(array.mean()), sd, len(array))


def paired_difference(values: Mapping[str, float], baseline: Mapping[str, float]
                      ) -> Difference | None:
    """:math:`\\bar d \\pm \\mathrm{SE}` of ``values[s] - baseline[s]`` over the seeds ``s`` both
    have (module docstring); None where they share no seed."""
    seeds = [seed for seed in values if seed in baseline]
    if not seeds:
        return None
    diffs = np.array([values[seed] - baseline[seed] for seed in seeds])
    se = float(diffs.std(ddof=1) / np.sqrt(len(diffs))) if len(diffs) > 1 else None
    return Difference(float(diffs.mean()), se, len(diffs))


def read_jobs(sweep_dir: Path) -> list[Job]:
    """The jobs of the sweep folder ``sweep_dir`` (each folder with ``.hydra/config.yaml``), in
    job order."""
    jobs = []
    for config_file in sorted(sweep_dir.glob("*/.hydra/config.yaml"),
                              key=lambda path: job_number(path.parents[1].name)):
        folder = config_file.parents[1]
        config = OmegaConf.load(config_file)
        overrides_file = folder / ".hydra" / "overrides.yaml"
        overrides = (dict(item.split("=", 1) for item in OmegaConf.load(overrides_file))
                     if overrides_file.is_file() else {})
        penalty = str(OmegaConf.select(config, "penalty.name", default=BASELINE))
        weight = OmegaConf.select(config, "penalty.weight", default=None,
                                  throw_on_resolution_failure=False)
        metrics_file = folder / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else None
        jobs.append(Job(penalty, effective_weight(penalty, weight),
                        str(OmegaConf.select(config, "seed", default="")), overrides, metrics,
                        folder))
    return jobs


def job_number(name: str) -> tuple[int, str]:
    """A job folder's number (``012_none`` -> 12) to sort by, then its name."""
    number = name.split("_", 1)[0]
    return (int(number) if number.isdigit() else 1 << 62, name)


def settings(jobs: Iterable[Job]) -> list[Setting]:
    """The settings of ``jobs``: the baselines first, then each penalty (in the order the
    jobs first meet it) by increasing λ; within those, by the other overrides."""
    jobs = list(jobs)
    keys = sorted({key for job in jobs for key in job.overrides} - set(OWN_KEYS))
    varying = [key for key in keys if len({job.overrides.get(key) for job in jobs}) > 1]
    grouped: dict[tuple, Setting] = {}
    for job in jobs:
        others = tuple((key, job.overrides.get(key, "")) for key in varying)
        key = (job.penalty, job.weight, others)
        grouped.setdefault(key, Setting(job.penalty, job.weight, others)).jobs.append(job)
    order = {penalty: k for k, penalty in enumerate(
        dict.fromkeys([BASELINE, *(job.penalty for job in jobs)]))}
    return sorted(grouped.values(),
                  key=lambda s: (order[s.penalty], s.weight, [value for _, value in s.others]))


def baseline_of(setting: Setting, all_settings: Sequence[Setting]) -> Setting | None:
    """The ``penalty=none`` setting with ``setting``'s other overrides; None where the sweep
    has none (or ``setting`` is a baseline)."""
    if setting.is_baseline:
        return None
    return next((other for other in all_settings
                 if other.is_baseline and other.others == setting.others), None)


def difference(setting: Setting, all_settings: Sequence[Setting], metric: str
               ) -> Difference | None:
    """``setting``'s paired difference from its baseline in ``metric`` (None without one)."""
    baseline = baseline_of(setting, all_settings)
    if baseline is None:
        return None
    return compare(setting, baseline, metric)


def compare(setting: Setting, other: Setting, metric: str) -> Difference | None:
    """``setting`` minus ``other`` in ``metric``, paired by seed (None without a common
    seed)."""
    return paired_difference(setting.per_seed(metric), other.per_seed(metric))


def logged_metrics(jobs: Iterable[Job]) -> set[str]:
    """The names of the metrics that any finished job of ``jobs`` saved."""
    return {name for job in jobs for name in job.metrics or {}}


def outcome_metrics(jobs: Iterable[Job], optimized: str | None = None) -> list[str]:
    """The metrics a sweep is judged by: the ``test/`` metrics its jobs logged (the
    ``val/`` ones where none logged a test metric), sorted, ``optimized`` first (its ``test/``
    counterpart where it is a ``val/`` metric with one)."""
    logged = logged_metrics(jobs)
    names = sorted(name for name in logged if name.startswith("test/")) or sorted(
        name for name in logged if name.startswith("val/"))
    first = optimized
    if optimized is not None and optimized.startswith("val/"):
        tested = "test/" + optimized.removeprefix("val/")
        first = tested if tested in names else optimized
    if first in logged:
        names = [first, *(name for name in names if name != first)]
    return names


def selection_metric(metric: str, logged: set[str]) -> str | None:
    """The validation metric that chooses a setting for the outcome ``metric``: ``val/<name>``
    for ``test/<name>`` where the jobs logged it; ``metric`` itself where it is a validation
    metric (a sweep without a test split); None where no validation metric matches (choosing on
    the test split would select on the test set)."""
    if metric.startswith("val/"):
        return metric
    validation = "val/" + metric.removeprefix("test/")
    return validation if metric.startswith("test/") and validation in logged else None


def job_results(sweep_dir: Path) -> list[tuple[dict[str, str], dict[str, float] | None]]:
    """Each job of a sweep, in job order: its overrides (``.hydra/overrides.yaml``) and its
    ``metrics.json`` (None where the job saved none: it failed or diverged)."""
    jobs = []
    for overrides_file in sorted(sweep_dir.glob("*/.hydra/overrides.yaml"),
                                 key=lambda path: job_number(path.parents[1].name)):
        overrides = dict(item.split("=", 1) for item in OmegaConf.load(overrides_file))
        metrics_file = overrides_file.parents[1] / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else None
        jobs.append((overrides, metrics))
    return jobs
