"""Log a run's hyperparameters, its metrics and how it ended, for TensorBoard's HParams tab.

A sweep (say, penalty weight against clean and PGD accuracy) is then compared run by run in one
table. TensorBoard's HParams plugin reads, per run, the hyperparameter values (a session start
with its start time) and how the run ended (a session end: status and time), and takes its
columns from ONE experiment declaration of the log folder (the first it reads); each metric's
value is the latest scalar under the metric's own tag. So:

* :class:`HParamsLogger` writes, once per run directory, the session start at the start of fit
  (or test): the module's ``hparams`` (``save_hyperparameters``), the weight of every
  :class:`~gradreg.penalties.GradientPenalty` submodule as ``penalty/weight/<module path>`` and
  the ``hparams`` given to it, without the ``None`` ones (a blank cell, not the word "None");
  and at the end of the run (``ends_after``: fit or test) the session end with status
  ``SUCCESS``, or at an exception (a crash, Ctrl-C) ``FAILURE``, each with its real time, and
  the run's own declaration: its hyperparameters and the configured metrics it logged (``first``
  leading), so a classifier run declares classifier metrics and a GAN run GAN metrics;
* :func:`declare_folder` writes the declaration of a whole log folder, in an event file of a run
  of its own (the app's sweeps: ``summary/``), from what its runs hold: every run's
  hyperparameters that have a value in every run and differ between runs (a column blank
  for some run would leave that run out of the parallel coordinates, and a constant one would
  take a visible slot from the metrics; all complete ones where none differs), and the union of
  the runs' metrics with ``first`` (the metric a search optimizes) leading. The runs write
  their declarations in event files of their own (``*_hparams_run``), which it removes: the
  folder's is then the only one, whatever order TensorBoard reads the runs in. The app writes
  it at the end of every sweep.

The metrics are the module's own tags (``val/acc``, ``test/acc_fgsm``), so nothing is logged
twice; a metric a run never logs is blank in its row.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
from torch.utils.tensorboard.writer import FileWriter

from gradreg.lightning.callbacks._logging import tensorboard, warn_without_tensorboard
from gradreg.lightning.callbacks._penalties import penalty_weights
from gradreg.lightning.compat import event_file_writer
from gradreg.lightning.dashboards.tags import PENALTY_WEIGHT

Value = bool | int | float | str

#: the suffixes of the event files of a run's declaration and of a folder's
#: (:func:`declare_folder` replaces the runs' with the folder's); appended to the writer's
#: ``<pid>.<n>``, so the name still ends in its process id and number
RUN_DECLARATION, FOLDER_DECLARATION = "_hparams_run", "_hparams_folder"
ENDS_AFTER = ("fit", "test")


def tensorboard_values(params: Mapping[str, Any], prefix: str = "") -> dict[str, Value]:
    """Nested mappings flattened to ``outer/inner`` keys; ``None`` values left out (TensorBoard
    shows a blank cell); other values TensorBoard cannot show (lists, objects) become their
    ``str``."""
    flat: dict[str, Value] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat.update(tensorboard_values(value, f"{prefix}{key}/"))
        elif value is not None:
            flat[f"{prefix}{key}"] = value if isinstance(value, Value) else str(value)
    return flat


def _summary(tag: str, data: plugin_data_pb2.HParamsPluginData) -> Summary:
    data.version = metadata.PLUGIN_DATA_VERSION
    plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME,
                                        content=data.SerializeToString())
    return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])


def _value_type(value: Value) -> int:
    if isinstance(value, bool):
        return api_pb2.DATA_TYPE_BOOL
    if isinstance(value, str):
        return api_pb2.DATA_TYPE_STRING
    return api_pb2.DATA_TYPE_FLOAT64


def session_start(params: Mapping[str, Value], start_time: float) -> Summary:
    """The session start: ``params`` (flat, as :func:`tensorboard_values` makes them) and the
    start time in seconds since the epoch."""
    info = plugin_data_pb2.SessionStartInfo(start_time_secs=start_time)
    for name, value in params.items():
        if isinstance(value, bool):
            info.hparams[name].bool_value = value
        elif isinstance(value, str):
            info.hparams[name].string_value = value
        else:
            info.hparams[name].number_value = float(value)
    return _summary(metadata.SESSION_START_INFO_TAG,
                    plugin_data_pb2.HParamsPluginData(session_start_info=info))


def session_end(succeeded: bool, end_time: float) -> Summary:
    """The session end: ``STATUS_SUCCESS`` or ``STATUS_FAILURE``, and the end time."""
    status = api_pb2.STATUS_SUCCESS if succeeded else api_pb2.STATUS_FAILURE
    info = plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=end_time)
    return _summary(metadata.SESSION_END_INFO_TAG,
                    plugin_data_pb2.HParamsPluginData(session_end_info=info))


def experiment(hparams: Mapping[str, tuple[int, bool]], metrics: Iterable[str]) -> Summary:
    """The declaration: ``hparams`` (name -> (its ``api_pb2`` data type, whether its values
    differ between runs)), listed with the differing ones first, then by name (as TensorBoard
    sorts them; its table shows the first five differing columns), and the metric tags in
    order."""
    ordered = sorted(hparams.items(), key=lambda item: (not item[1][1], item[0]))
    declared = api_pb2.Experiment(
        hparam_infos=[api_pb2.HParamInfo(name=name, type=kind, differs=differs)
                      for name, (kind, differs) in ordered],
        metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag)) for tag in metrics])
    return _summary(metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(
        experiment=declared))


class HParamsLogger(pl.Callback):
    """Hyperparameters at the start, the declaration and the end status at the end of a run.

    Args:
        metrics: scalar tags to compare runs by (e.g. ``["val/acc", "test/acc_fgsm"]``), for
            every module kind; a run declares those it logged (all of them where it logged none
            before it ended), the table shows each one's latest value.
        hparams: extra hyperparameters (e.g. a flattened experiment config); ``None`` values are
            left out.
        first: the metric listed first (e.g. what a search optimizes); TensorBoard shows the
            first five metric columns by default.
        ends_after: ``"fit"`` or ``"test"``: the stage whose end is the run's end (the app tests
            after fitting: ``"test"``).
        weight_columns: whether each penalty submodule's weight is a column of its own,
            ``penalty/weight/<module path>`` (blank in the rows of runs without that penalty);
            the app logs one ``weight`` column instead, 0 for ``penalty=none``, in ``hparams``.
    """

    def __init__(self, metrics: Sequence[str], hparams: Mapping[str, Any] | None = None,
                 *, first: str | None = None, ends_after: str = "fit",
                 weight_columns: bool = True) -> None:
        if isinstance(metrics, str):
            raise ValueError(f"metrics must be a list of names, got the string {metrics!r}; "
                             f"write metrics=[{metrics!r}].")
        if not metrics:
            raise ValueError(f"metrics must be a non-empty list of metric names, got "
                             f"{metrics!r}; e.g. metrics=['val/acc'].")
        if ends_after not in ENDS_AFTER:
            raise ValueError(f"ends_after must be one of {list(ENDS_AFTER)}, got {ends_after!r}.")
        self.metrics = tuple(dict.fromkeys([*([first] if first else []), *metrics]))
        self.hparams = dict(hparams or {})
        self.ends_after = ends_after
        self.weight_columns = weight_columns
        self.params: dict[str, Value] = {}
        self.logged: set[str] = set()
        self._started: set[str] = set()
        self._ended: set[str] = set()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.logged.update(trainer.callback_metrics)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.logged.update(trainer.callback_metrics)
        if self.ends_after == "test":
            self._end(trainer, succeeded=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.logged.update(trainer.callback_metrics)
        if self.ends_after == "fit":
            self._end(trainer, succeeded=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._end(trainer, succeeded=False)

    def _writer(self, trainer: pl.Trainer) -> Any:
        """TensorBoard's event file writer on global rank 0 (the only rank whose logger has a
        writer; on the others Lightning hands out a stand-in), else None."""
        writer = tensorboard(trainer)
        if not trainer.is_global_zero or writer is None:
            return None
        return writer

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "HParamsLogger", "hyperparameters and metrics")
        writer = self._writer(trainer)
        if writer is None or writer.log_dir in self._started:
            return
        weights = ({f"{PENALTY_WEIGHT}/{name}": weight
                    for name, weight in penalty_weights(pl_module).items()}
                   if self.weight_columns else {})
        self.params = tensorboard_values({**pl_module.hparams, **weights, **self.hparams})
        file_writer = event_file_writer(writer)
        file_writer.add_summary(session_start(self.params, time.time()))
        file_writer.flush()
        self._started.add(writer.log_dir)

    def _end(self, trainer: pl.Trainer, succeeded: bool) -> None:
        writer = self._writer(trainer)
        if writer is None or writer.log_dir not in self._started or writer.log_dir in self._ended:
            return
        metrics = [tag for tag in self.metrics if tag in self.logged] or list(self.metrics)
        columns = {name: (_value_type(value), False) for name, value in self.params.items()}
        file_writer = event_file_writer(writer)
        file_writer.add_summary(session_end(succeeded, time.time()))
        file_writer.flush()
        declaration = FileWriter(writer.log_dir, filename_suffix=RUN_DECLARATION)
        declaration.add_summary(experiment(columns, metrics))
        declaration.close()
        self._ended.add(writer.log_dir)


def declare_folder(folder: str | Path, first: str | None = None, run: str | None = None
                   ) -> list[str]:
    """Write the HParams declaration of the log folder ``folder`` from its runs (module
    docstring), replacing an earlier one; returns the metric tags declared. It goes in the
    run ``folder/run`` (a run without hyperparameters of its own, e.g. a sweep's summary), or at
    ``folder``'s root without ``run`` (where TensorBoard lists it as a run named ``.``). Nothing
    is written where no run under ``folder`` has hyperparameters."""
    folder = Path(folder)
    values: dict[str, list[Value]] = {}
    kinds: dict[str, int] = {}
    metrics: list[str] = []
    runs = sorted({path.parent for path in folder.rglob("events.out.tfevents.*")})
    for run_dir in runs:
        content = _hparams_content(run_dir)
        if metadata.SESSION_START_INFO_TAG not in content:
            continue
        start = plugin_data_pb2.HParamsPluginData.FromString(
            content[metadata.SESSION_START_INFO_TAG]).session_start_info
        for name, value in start.hparams.items():
            kind = value.WhichOneof("kind")
            kinds[name] = {"bool_value": api_pb2.DATA_TYPE_BOOL,
                           "string_value": api_pb2.DATA_TYPE_STRING}.get(
                               kind, api_pb2.DATA_TYPE_FLOAT64)
            values.setdefault(name, []).append(getattr(value, kind))
        if metadata.EXPERIMENT_TAG in content:
            declared = plugin_data_pb2.HParamsPluginData.FromString(
                content[metadata.EXPERIMENT_TAG]).experiment
            metrics += [info.name.tag for info in declared.metric_infos
                        if info.name.tag not in metrics]
    if not values:
        return []
    if first is not None:
        metrics = [first, *(tag for tag in metrics if tag != first)]
    sessions = max(len(seen) for seen in values.values())
    # a column blank for some run (weight_log10 of penalty=none, a GAN's n_critic beside a
    # classifier) would leave that run out of the parallel coordinates; a column equal in every
    # run would take a visible slot from the metrics: declare the others (all, where none
    # differs)
    complete = {name: seen for name, seen in values.items() if len(seen) == sessions}
    differing = {name for name, seen in complete.items() if len(set(seen)) > 1}
    columns = {name: (kinds[name], name in differing) for name in complete
               if name in differing or not differing}
    for old in folder.rglob(f"events.out.tfevents.*{FOLDER_DECLARATION}"):
        old.unlink()
    writer = FileWriter(str(folder / run if run else folder), filename_suffix=FOLDER_DECLARATION)
    writer.add_summary(experiment(columns, metrics))
    writer.close()
    for run_declaration in folder.rglob(f"events.out.tfevents.*{RUN_DECLARATION}"):
        run_declaration.unlink()
    return metrics


def _hparams_content(run: Path) -> dict[str, bytes]:
    """The HParams plugin's tags of the run in folder ``run`` (its own event files, not those
    of its sub-folders): tag -> the content of its first summary, as TensorBoard reads it."""
    content: dict[str, bytes] = {}
    for path in sorted(run.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                plugin = value.metadata.plugin_data
                if plugin.plugin_name == metadata.PLUGIN_NAME:
                    content.setdefault(value.tag, plugin.content)
    return content
