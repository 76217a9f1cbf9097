"""``hydra/sweeper=grid``: Hydra's basic sweeper without the jobs that repeat another
(:func:`gradreg.app.sweeps.grid.distinct_jobs`)."""

from __future__ import annotations

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override

from gradreg.app.sweeps.grid import distinct_jobs


class GridSweeper(BasicSweeper):
    """The cartesian product of the command line's sweeps, each ``penalty=none`` job once per
    setting of the keys it does not ignore, in batches of ``max_batch_size`` jobs."""

    @staticmethod
    def split_arguments(overrides: list[Override], max_batch_size: int | None
                        ) -> list[list[list[str]]]:
        jobs = distinct_jobs(BasicSweeper.split_arguments(overrides, None)[0])
        size = max_batch_size or len(jobs)
        return [jobs[start:start + size] for start in range(0, len(jobs), size)]
