"""The jobs of a grid sweep (``-m key=a,b ...``): Hydra's cartesian product, less the jobs that
repeat another.

``penalty=none`` ignores every ``penalty.*`` key (its ``weight``, ``method``, ...), so in
``-m penalty=none,double_backprop penalty.weight=0.03,0.1,0.3,1 seed=0,1,2`` the product has
four ``none`` jobs per seed that compute the same run. :func:`distinct_jobs` keeps the first of
them (with the first weight in its overrides, which the run ignores: its λ is 0): one baseline
job per seed and per setting of the other keys. The sweeper of the app
(``hydra/sweeper=grid``, the default of configs/train.yaml) launches these.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..run_names import NO_PENALTY

#: the config node that ``penalty=none`` ignores
IGNORED_BY_NONE = "penalty."
#: Hydra's warning on configs/hydra/sweeper/basic.yaml (a regex of its message)
SCHEMA_WARNING = r"\s*'hydra/sweeper/basic' is validated against ConfigStore schema"


def distinct_jobs(jobs: Sequence[Sequence[str]]) -> list[list[str]]:
    """``jobs`` (each a list of ``key=value`` overrides, in Hydra's order) without those that
    repeat an earlier one: a job with ``penalty=none`` whose overrides differ from an earlier
    such job's only in ``penalty.*`` keys (``+penalty.every=2`` too)."""
    seen: set[tuple[str, ...]] = set()
    kept = []
    for job in jobs:
        if f"penalty={NO_PENALTY}" in job:
            identity = tuple(item for item in job
                             if not item.lstrip("+~").startswith(IGNORED_BY_NONE))
            if identity in seen:
                continue
            seen.add(identity)
        kept.append(list(job))
    return kept
