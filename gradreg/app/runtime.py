"""The process a run trains in: torch's CPU threads, and what Lightning and torch print.

Threads: torch runs each CPU op on ``torch.get_num_threads()`` OpenMP threads (all cores by
default), and every op waits for its slowest thread. The app's models are small, so each op is
short and the wait dominates: when another process holds a core, the thread scheduled there
stalls every op. Measured on 2 vCPUs with a second process busy: ``experiment=moons_jacobian``
took 170 s with torch's 2 threads and 15 s with one. ``threads`` (default 1) sets the count, for
torch and for every other native thread pool of the process (:func:`limit_threads`): OpenBLAS
under numpy and scipy and scikit-learn's OpenMP runtime start one thread per core too, and
spin between calls.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Mapping

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.strategies import DDPStrategy
from threadpoolctl import threadpool_limits

from gradreg.lightning.compat import relaunches_script
from gradreg.lightning.global_batch import GlobalBatchDDPStrategy, check_splittable
from gradreg.penalties import GradientPenalty

from .console import route_lightning
from .invocation import command

#: Warnings that say nothing about the run: library internals, and facts the app documents.
IGNORED_WARNINGS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"The number of training batches \(\d+\) is smaller than the logging interval",
    r"The dirpath has changed from",  # a resumed run writes to a folder of its own
)


class _NoTips(logging.Filter):
    """Drops Lightning's advertisements ("💡 Tip: ... try installing ...")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


#: the variables the native thread pools read when their library loads: OpenMP runtimes (torch's,
#: scikit-learn's), OpenBLAS (numpy's, scipy's), MKL
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def limit_threads(threads: int) -> None:
    """Run every CPU thread pool of this process and of the processes it starts on ``threads``
    threads: torch's (``torch.set_num_threads``), the pools of the native libraries already
    loaded (threadpoolctl: OpenBLAS under numpy and scipy, the OpenMP runtimes), and, through
    :data:`THREAD_VARIABLES` in the environment, those of libraries loaded later (scikit-learn's
    OpenMP when the digits are loaded) and of the DDP ranks and sweep jobs started from here."""
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    torch.set_num_threads(threads)
    threadpool_limits(limits=threads)


def configure(threads: int | None) -> None:
    """Set the process's CPU threads (:func:`limit_threads`; None: each library's default),
    silence what does not concern the run, and send Lightning's messages to the console once
    and to the run's log file (:func:`~gradreg.app.console.route_lightning`)."""
    if threads is not None:
        limit_threads(threads)
    for message in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    route_lightning(_NoTips())


class EndProgressLines(L.Callback):
    """Ends the lines of Lightning's tqdm progress bars when a run stops (Ctrl-C, SIGTERM, an
    error while training): tqdm redraws a bar with a carriage return and no newline, and
    Lightning closes it only where its loop ends, so the app's ``error:`` line would start where
    the bar ends. Closing a bar that is closed, or that never opened, does nothing."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        bars = trainer.progress_bar_callback
        if not isinstance(bars, TQDMProgressBar):  # Rich's ends its own lines on an exception
            return
        for stage in ("predict", "test", "val", "train"):  # the inner bars first
            try:
                bar = getattr(bars, f"{stage}_progress_bar")
            except TypeError:  # "has not been set yet": the stage never drew one
                continue
            bar.close()


def progress_bar(configured: bool | None) -> bool:
    """The progress bar: as configured, or (None) only where stdout is a terminal: redrawn bars
    fill a log file or a CI log with thousands of lines."""
    return sys.stdout.isatty() if configured is None else configured


def ddp_strategy(strategy: object, manual_optimization: bool, global_batch: bool = False
                 ) -> object:
    """``"ddp"`` / ``"ddp_spawn"`` with DDP's ``find_unused_parameters`` for modules with manual
    optimization, whose phases leave a network without gradient (plain DDP stops them at their
    second step); unchanged otherwise (where it finds no unused parameter, torch warns once per
    rank that the search slows every step). With ``global_batch`` (``data.global_batch``), the
    same DDP as a :class:`~gradreg.lightning.global_batch.GlobalBatchDDPStrategy`, which weights
    the ranks' slices of a batch that does not divide over them."""
    if strategy not in ("ddp", "ddp_spawn"):
        return strategy
    if global_batch:
        return GlobalBatchDDPStrategy(find_unused_parameters=manual_optimization,
                                      start_method="popen" if strategy == "ddp" else "spawn")
    return f"{strategy}_find_unused_parameters_true" if manual_optimization else strategy


def check_global_batch(trainer: L.Trainer, penalties: Mapping[str, GradientPenalty]) -> None:
    """Raise ``ValueError`` where ``data.global_batch`` cannot give the one-process steps: more
    than one rank under a strategy that does not weight the ranks' slices
    (:class:`~gradreg.lightning.global_batch.GlobalBatches`: DDP's, and FSDP2's with
    ``global_batch``), or a penalty of the parameter gradient with accumulated micro-batches
    (:func:`~gradreg.lightning.global_batch.check_splittable`)."""
    if trainer.world_size > 1 and not getattr(trainer.strategy, "weights_global_batches", False):
        raise ValueError(
            f"global batches are split over the ranks by DDP and FSDP2 (trainer=ddp_cpu, "
            f"ddp_spawn_cpu, fsdp_cpu), not by {type(trainer.strategy).__name__}: use one of "
            "them, or data.global_batch=false (data.batch_size per rank)")
    check_splittable(penalties, trainer.world_size, trainer.accumulate_grad_batches)


def check_launcher(trainer: L.Trainer) -> None:
    """Refuse, inside a Hydra multirun, a strategy that re-launches this script per rank.

    Such a child re-runs the whole sweep (``-m`` is in its command line) with its own
    timestamped output directories. DDP can start its ranks as processes of the current job
    instead (``ddp_spawn``); Lightning's ModelParallelStrategy, which ``trainer=fsdp_cpu``'s
    ShardedPenaltyStrategy extends, only re-launches, so a sharded job runs without ``-m``.
    """
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    if not relaunches_script(trainer):
        return
    chosen = HydraConfig.get().runtime.choices.get("trainer")
    strategy = type(trainer.strategy).__name__
    problem = (f"strategy {strategy} (trainer={chosen}) re-launches the command line for each "
               "extra rank, which inside a multirun (-m) re-runs the whole sweep with its own "
               "output directories; ")
    if isinstance(trainer.strategy, DDPStrategy):
        raise ValueError(
            problem + "use trainer=ddp_spawn_cpu (or trainer.strategy=ddp_spawn: the ranks are "
            "processes of each job), or run each job without -m")
    raise ValueError(
        problem + f"{strategy} has no launcher that starts the ranks inside the job, so run "
        f"each job without -m, one command per value (e.g. {' '.join(command())} "
        f"trainer={chosen} seed=0, then seed=1), or sweep with trainer=ddp_spawn_cpu, which "
        "does not shard (every rank holds every parameter)")
