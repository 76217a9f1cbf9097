"""The end of every sweep: which λ won, by how much, over seeds.

:class:`SweepSummary` (a Hydra callback, ``hydra.callbacks.sweep_summary`` in configs/train.yaml)
reads the sweep's jobs (:mod:`gradreg.app.sweeps.results`) and writes in the sweep folder:

* ``summary.md`` (also printed): per outcome metric, each setting's mean ± SD over seeds and its
  difference from the ``penalty=none`` baseline paired by seed ± its standard error, the best
  marked where the difference exceeds the noise (:mod:`gradreg.app.sweeps.table`);
* ``metric_vs_weight.png``: each outcome metric against λ on a log axis, mean and band over
  seeds, the baseline as a horizontal band (:mod:`gradreg.app.sweeps.figure`);
* ``validation_curves.png``, where the jobs logged to TensorBoard: each outcome metric's
  validation values over training, every run, one colour per setting named by its λ in the
  legend, axes that hold every value (:mod:`gradreg.app.sweeps.curves`);

and where the jobs logged to TensorBoard, a run of its own, ``summary/``, holding the figure
(tag ``Sweep/metric_vs_weight``: first in Time Series, where TensorBoard opens, its title saying
which setting was chosen) and the validation curves (``Sweep/validation_curves``),
``summary.md`` (Text tab, ``Sweep/summary``) and the HParams declaration of the sweep folder
(:func:`gradreg.lightning.callbacks.hparams.declare_folder`: the columns that vary between the
jobs and their metrics, the optimized one first), so that no stray run ``.`` holds it; where they
logged to MLflow or W&B (``logger=mlflow``, ``logger=wandb``), a run ``summary`` of the sweep
there with the summary and the figures (:func:`gradreg.app.trackers.log_sweep_summary`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ..console import say
from .curves import validation_curves_figure
from .figure import metric_vs_weight_figure
from .results import read_jobs
from .table import summary_markdown

FIGURE = "metric_vs_weight.png"
CURVES = "validation_curves.png"
SUMMARY = "summary.md"
#: the TensorBoard run of the sweep folder that holds the summary and the HParams declaration
SUMMARY_RUN = "summary"
# capitalized, the tags sort before the runs' own (all lower case): TensorBoard's Time Series,
# where it opens, shows the figure first, expanded, and the Text tab the summary
FIGURE_TAG, CURVES_TAG, TEXT_TAG = ("Sweep/metric_vs_weight", "Sweep/validation_curves",
                                    "Sweep/summary")
#: the loggers whose sweeps get a run ``summary`` of their own (gradreg/app/trackers.py)
TRACKERS = "gradreg.app.trackers."


class SweepSummary(Callback):
    """Hydra callback: at the end of a sweep, its summary, figure and TensorBoard run (module
    docstring). A sweep without a finished job: nothing."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = read_jobs(sweep_dir)
        if not any(job.metrics is not None for job in jobs):
            return
        optimized = config.get("optimized_metric")
        direction = config.hydra.sweeper.get("direction")
        direction = direction if isinstance(direction, str) else None
        body = summary_markdown(jobs, optimized, direction)
        (sweep_dir / SUMMARY).write_text(f"# sweep {sweep_dir}\n\n{body}")
        say(f"\nsweep summary ({sweep_dir / SUMMARY}):\n{body}")
        figure = metric_vs_weight_figure(
            jobs, optimized, title=f"sweep {sweep_dir.parent.name}/{sweep_dir.name}",
            direction=direction)
        drawn = []
        if figure is not None:
            figure.savefig(sweep_dir / FIGURE)
            say(f"metric vs λ: {sweep_dir / FIGURE}")
            drawn.append(sweep_dir / FIGURE)
        if any(sweep_dir.glob("*/**/events.out.tfevents.*")):
            curves = validation_curves_figure(
                jobs, optimized, title=f"sweep {sweep_dir.parent.name}/{sweep_dir.name}")
            if curves is not None:
                curves.savefig(sweep_dir / CURVES)
                say(f"validation curves: {sweep_dir / CURVES}")
                drawn.append(sweep_dir / CURVES)
            log_summary(sweep_dir, body, figure, optimized, curves)
        if any(str(node.get("_target_", "")).startswith(TRACKERS)
               for node in (config.get("logger") or {}).values() if node is not None):
            from ..trackers import log_sweep_summary  # Lightning, MLflow, W&B: only here

            log_sweep_summary(config, sweep_dir, sweep_dir / SUMMARY, drawn)


def log_summary(sweep_dir: Path, body: str, figure: Any, optimized: str | None,
                curves: Any = None) -> None:
    """The ``summary`` run of the sweep folder (module docstring), replacing an earlier one's
    figures and text."""
    from torch.utils.tensorboard import SummaryWriter

    from gradreg.lightning.callbacks.hparams import declare_folder

    run = sweep_dir / SUMMARY_RUN
    for old in run.glob("events.out.tfevents.*"):
        old.unlink()
    writer = SummaryWriter(str(run))
    writer.add_text(TEXT_TAG, body)
    if figure is not None:
        writer.add_figure(FIGURE_TAG, figure, close=False)
    if curves is not None:
        writer.add_figure(CURVES_TAG, curves, close=False)
    writer.close()
    declare_folder(sweep_dir, first=optimized, run=SUMMARY_RUN)
