"""The process a run trains in: torch's CPU threads, and what Lightning and torch print.

Threads: torch runs each CPU op on ``torch.get_num_threads()`` OpenMP threads (all cores by
default), and every op waits for its slowest thread. The app's models are small, so each op is
short and the wait dominates: when another process holds a core, the thread scheduled there
stalls every op. Measured on 2 vCPUs with a second process busy: ``experiment=moons_jacobian``
took 170 s with torch's 2 threads and 15 s with one. ``threads`` (default 1) sets the count.
"""

from __future__ import annotations

import logging
import sys
import warnings

import torch
from omegaconf import OmegaConf

from .sweeps import short_number, swept_keys

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


def configure(threads: int | None) -> None:
    """Set torch's CPU threads (None: torch's default) and silence what does not concern the
    run."""
    if threads is not None:
        torch.set_num_threads(threads)
    for message in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    for target in [*loggers, *loggers[0].handlers]:  # records logged there, or passed on to it
        if not any(isinstance(f, _NoTips) for f in target.filters):
            target.addFilter(_NoTips())


def progress_bar(configured: bool | None) -> bool:
    """The progress bar: as configured, or (None) only where stdout is a terminal: redrawn bars
    fill a log file or a CI log with thousands of lines."""
    return sys.stdout.isatty() if configured is None else configured


def ddp_strategy(strategy: object, manual_optimization: bool) -> object:
    """``"ddp"`` / ``"ddp_spawn"`` with DDP's ``find_unused_parameters`` for modules with manual
    optimization, whose phases leave a network without gradient (plain DDP stops them at their
    second step); unchanged otherwise (where it finds no unused parameter, torch warns once per
    rank that the search slows every step)."""
    if manual_optimization and strategy in ("ddp", "ddp_spawn"):
        return f"{strategy}_find_unused_parameters_true"
    return strategy


def run_folder_suffix(overrides: str, only_swept: bool = False, limit: int = 120) -> str:
    """``_<overrides>`` for a run folder, from Hydra's ``override_dirname`` (``key:value`` joined
    by ``+``, configs/train.yaml; sorted by key). ``only_swept``: just the keys the command line
    sweeps (the folder of a sweep's job: what tells it from its siblings; the sweep's own folder
    is the time it started). ``/`` and ``,`` inside values become ``_`` (a folder name, and a
    value ``ckpt_path=`` accepts without quotes), floats longer than 4 significant digits are
    shortened to 4 (a sampler's values); whole overrides past ``limit`` characters are left out
    (``+...``); ``""`` without overrides."""
    items = [item for item in overrides.replace("/", "_").replace(",", "_").split("+") if item]
    items = [f"{key}:{short_number(value)}" if sep else key
             for key, sep, value in (item.partition(":") for item in items)]
    if only_swept:
        keys = swept_keys(sys.argv)
        items = [item for item in items if item.split(":", 1)[0] in keys]
    kept = ""
    for item in items:
        if len(kept) + len(item) + 1 > limit:
            return f"_{kept}+..."
        kept = f"{kept}+{item}" if kept else item
    return f"_{kept}" if kept else ""


# registered where it is defined: a job unpickled in a process of its own (submitit) imports
# this module with the task function, before Hydra names the job's folder
OmegaConf.register_new_resolver("run_folder_suffix", run_folder_suffix, replace=True)
