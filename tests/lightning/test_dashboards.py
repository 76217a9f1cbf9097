"""Dashboards as a user sees them: the layout, the HParams table, the critic's gradient norm at the
interpolates, the snapshot and the logger, read from the event files."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from matplotlib.image import imread
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from torch import Tensor

from gradreg.lightning import dashboards
from gradreg.lightning.callbacks import (
    CustomScalarsLayout,
    GradientNormMonitor,
    HParamsLogger,
    InterpolatesGradientNorm,
    PenaltyWeightSchedule,
    SaliencyMaps,
)
from gradreg.lightning.callbacks.hparams import declare_folder, tensorboard_values
from gradreg.penalties import r1
from tests.lightning.helpers import (
    BATCH,
    WEIGHT,
    PlainClassifier,
    PlainGan,
    events,
    fit,
    loader,
    real_points,
    scalars,
    trainer,
)

# --- custom scalars ------------------------------------------------------------------------------


def layout_charts(run: pl.Trainer) -> dict[str, list[str]]:
    """The custom-scalars layout as TensorBoard's plugin reads it: title -> regexes."""
    accumulator = events(run)
    assert list(accumulator.PluginTagToContent("custom_scalars")) == ["custom_scalars__config__"]
    (event,) = accumulator.Tensors("custom_scalars__config__")
    (category,) = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0]).category
    assert category.title == "gradreg"
    return {chart.title: list(chart.multiline.tag) for chart in category.chart}


def matched(run: pl.Trainer, charts: dict[str, list[str]]) -> dict[str, list[str]]:
    tags = events(run).Tags()["scalars"]
    return {title: sorted(t for t in tags if any(re.match(r, t) for r in regexes))
            for title, regexes in charts.items()}


def test_layout_is_logged_and_every_chart_matches_logged_tags(tmp_path: Path) -> None:
    callbacks = [CustomScalarsLayout(outcome=["accuracy"]), GradientNormMonitor(),
                 PenaltyWeightSchedule(steps=2)]
    run = fit(tmp_path, PlainClassifier(), callbacks, limit_val_batches=1)
    charts = layout_charts(run)
    # the outcome first; weighted and unweighted penalties in charts of their own, each
    # unweighted penalty on its own chart; the task loss of training only
    clean = dashboards.CHARTS["accuracy"][0]
    assert next(iter(charts)) == clean
    assert clean == ("outcome: val/acc, clean accuracy (validation; final values: HParams tab, "
                     "smoothing and 'ignore outliers' hide them)")
    assert matched(run, charts) == {
        clean: ["val/acc"],
        "task loss (train)": ["train/loss"],
        "loss + penalty (train): what is backpropagated": ["loss/total"],
        "penalty gp, unweighted P": ["penalty/unweighted/gp"],
        "penalties, weighted: λ·P as added to the loss": ["penalty/weighted/gp"],
        "penalty weights λ": ["penalty/weight/gp"],
        "parameter gradient norm ‖∂L/∂θ‖ per optimizer": ["grad_norm/total"],
        "input gradient norm ‖∇x ℓ‖: batch mean and max": ["input_grad/norm_max",
                                                           "input_grad/norm_mean"],
    }
    assert "val/loss" in events(run).Tags()["scalars"]


def test_a_gan_and_a_classifier_share_the_charts_they_both_have(tmp_path: Path) -> None:
    """TensorBoard merges the layouts of a folder's runs, keeping one copy of equal charts: the
    shared charts are equal, so no title appears twice, and none is empty for both."""
    classifier = fit(tmp_path / "classifier", PlainClassifier(),
                     [CustomScalarsLayout(), GradientNormMonitor()])
    gan = trainer(tmp_path / "gan", [CustomScalarsLayout(), GradientNormMonitor(loss_fn=None),
                                     InterpolatesGradientNorm(critic="discriminator")],
                  max_steps=4)
    gan.fit(PlainGan(), real_points())
    mine, theirs = layout_charts(classifier), layout_charts(gan)
    shared = mine.keys() & theirs.keys()
    assert all(mine[title] == theirs[title] for title in shared)
    assert set(mine) - shared == {"input gradient norm ‖∇x ℓ‖: batch mean and max"}
    assert set(theirs) - shared == {
        "critic gradient norm ‖∇D(x̂)‖ at interpolates: mean and target"}
    assert matched(gan, theirs)["penalty gp, unweighted P"] == ["penalty/unweighted/gp"]
    assert matched(gan, theirs)["loss + penalty (train): what is backpropagated"] == [
        "loss/total/discriminator", "loss/total/generator"]


class Unpenalized(PlainClassifier):
    """The same classifier without a penalty."""

    def __init__(self) -> None:
        super().__init__()
        del self.gp

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        return torch.nn.functional.cross_entropy(self(x), y)


def test_a_module_without_penalties_gets_no_empty_penalty_charts(tmp_path: Path) -> None:
    run = fit(tmp_path, Unpenalized(), [CustomScalarsLayout(), GradientNormMonitor()])
    charts = matched(run, layout_charts(run))
    assert list(charts) == ["task loss (train)", "parameter gradient norm ‖∂L/∂θ‖ per optimizer",
                            "input gradient norm ‖∇x ℓ‖: batch mean and max",
                            "loss + penalty (train): what is backpropagated"]
    assert all(charts.values())  # every chart has data


def test_each_outcome_metric_and_each_layers_gradient_split_get_a_chart() -> None:
    """With many runs, one chart per metric and per layer: a chart per layer holds each run's
    task and penalty parts of that layer only."""
    layout = dashboards.custom_scalars_layout(
        charts=["accuracy", "accuracy_fgsm", "accuracy_pgd", "grad_split"],
        layers=["backbone.fc1", "backbone.out"])["gradreg"]
    assert [regexes for _, regexes in layout.values()] == [
        ["val/acc$"], ["val/acc_fgsm$"], ["val/acc_pgd$"],
        [r"grad_split/(task|penalty)/backbone\.fc1$"],
        [r"grad_split/(task|penalty)/backbone\.out$"]]
    assert list(layout)[3] == "gradient of layer backbone.fc1: ‖∂L_task/∂θ‖ and ‖∂(λ·P)/∂θ‖"
    tags = ["grad_split/task/backbone.fc1", "grad_split/penalty/backbone.fc1",
            "grad_split/penalty/backbone.fc10", "grad_split/cosine/backbone.fc1"]
    (_, fc1) = layout["gradient of layer backbone.fc1: ‖∂L_task/∂θ‖ and ‖∂(λ·P)/∂θ‖"]
    assert [tag for tag in tags if re.match(fc1[0], tag)] == tags[:2]


def test_layout_rejects_unknown_outcome_charts() -> None:
    with pytest.raises(ValueError, match=r"unknown outcome charts \['acc'\]; the outcome charts "
                                         r"are \['accuracy', 'accuracy_fgsm', 'accuracy_pgd', "
                                         r"'energy_distance', 'feature_energy_distance', "
                                         r"'modes'\]"):
        CustomScalarsLayout(outcome=["acc"])


def test_layout_rejects_a_bare_string() -> None:
    with pytest.raises(ValueError, match=r"write loss=\['train/loss'\]"):
        CustomScalarsLayout(loss="train/loss")


def test_callbacks_warn_without_tensorboard(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="CustomScalarsLayout writes the layout to TensorBoard, "
                                         "but the Trainer has no TensorBoardLogger"):
        fit(tmp_path, PlainClassifier(), [CustomScalarsLayout()], logger=CSVLogger(tmp_path))


# --- HParams -------------------------------------------------------------------------------------


def hparams_plugin_data(run: pl.Trainer, tag: str) -> Any:
    content = events(run).PluginTagToContent("hparams")[f"_hparams_/{tag}"]
    return plugin_data_pb2.HParamsPluginData.FromString(content)


class Crashes(PlainClassifier):
    """Raises in its third training step, as a diverged or broken run does."""

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        if self.global_step == 2:
            raise RuntimeError("broken at step 2")
        return super().training_step(batch, batch_idx)


def test_hparams_record_values_times_status_and_the_metrics_the_run_logged(tmp_path: Path
                                                                           ) -> None:
    module = PlainClassifier(weight=WEIGHT, lr=0.1)
    logger = HParamsLogger(["val/acc", "val/acc_pgd", "test/acc"], {"sweep": "a", "width": None},
                           first="test/acc", ends_after="test")
    before = time.time()
    run = fit(tmp_path, module, [logger], limit_val_batches=1)
    assert "_hparams_/session_end_info" not in events(run).PluginTagToContent("hparams")
    run.test(module, loader())
    after = time.time()

    start = hparams_plugin_data(run, "session_start_info").session_start_info
    assert set(start.hparams) == {"weight", "lr", "penalty/weight/gp", "sweep"}
    assert start.hparams["weight"].number_value == WEIGHT
    assert start.hparams["lr"].number_value == 0.1
    assert start.hparams["penalty/weight/gp"].number_value == WEIGHT
    assert start.hparams["sweep"].string_value == "a"
    assert "width" not in start.hparams  # None: a blank cell, not the string 'None'
    end = hparams_plugin_data(run, "session_end_info").session_end_info
    assert end.status == api_pb2.STATUS_SUCCESS
    assert before <= start.start_time_secs <= end.end_time_secs <= after
    experiment = hparams_plugin_data(run, "experiment").experiment
    # first leads; val/acc_pgd, never logged by this module, is not declared
    assert [info.name.tag for info in experiment.metric_infos] == ["test/acc", "val/acc"]
    assert {info.name: info.differs for info in experiment.hparam_infos} == {
        "lr": False, "weight": False, "penalty/weight/gp": False, "sweep": False}
    # the table's values are the metrics' own latest scalars; nothing is logged twice
    tags = events(run).Tags()["scalars"]
    assert not [tag for tag in tags if tag.startswith("hp")]
    assert {"val/acc", "test/acc"} <= set(tags)


def test_a_crashed_run_ends_as_a_failure(tmp_path: Path) -> None:
    logger = HParamsLogger(["val/acc"], ends_after="test")
    run = trainer(tmp_path, [logger])
    with pytest.raises(RuntimeError, match="broken at step 2"):
        run.fit(Crashes(), loader())
    end = hparams_plugin_data(run, "session_end_info").session_end_info
    assert end.status == api_pb2.STATUS_FAILURE
    start = hparams_plugin_data(run, "session_start_info").session_start_info
    assert start.start_time_secs <= end.end_time_secs
    # it logged none of the metrics: all of them are declared
    experiment = hparams_plugin_data(run, "experiment").experiment
    assert [info.name.tag for info in experiment.metric_infos] == ["val/acc"]


class Interrupted(PlainClassifier):
    """Ctrl-C in its second training step."""

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        if self.global_step == 1:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


def test_an_interrupted_run_is_not_a_success(tmp_path: Path) -> None:
    """Lightning shuts down gracefully on Ctrl-C (and exits); the run's status is FAILURE."""
    run = trainer(tmp_path, [HParamsLogger(["val/acc"])])
    with pytest.raises(SystemExit):
        run.fit(Interrupted(), loader())
    end = hparams_plugin_data(run, "session_end_info").session_end_info
    assert end.status == api_pb2.STATUS_FAILURE


def test_a_folder_declaration_marks_the_columns_that_differ_and_replaces_the_runs(
        tmp_path: Path) -> None:
    """Three runs, weights 0.5, 0.5 and 2 at one lr, the last with a column of its own: the
    folder's declaration has weight (and the penalty's weight under its tag), which differ, not
    lr, equal in every run (it would take a visible slot from the metrics), nor the last run's
    own column (blank in the others, it would leave them out of the parallel coordinates); the
    metrics are the runs' with ``first`` leading; the runs' own declarations are gone, so
    TensorBoard reads one."""
    for index, weight in enumerate([WEIGHT, WEIGHT, 2.0]):
        module = PlainClassifier(weight=weight, lr=0.1)
        own = {"only_here": 1.0} if index == 2 else None
        run = trainer(tmp_path / f"run{index}",
                      [HParamsLogger(["val/acc", "val/loss"], hparams=own)],
                      limit_val_batches=1)
        run.fit(module, loader(), loader())
    metrics = declare_folder(tmp_path, first="val/loss")
    assert metrics == ["val/loss", "val/acc"]
    assert not list(tmp_path.rglob("*_hparams_run"))
    assert len(list(tmp_path.glob("events.out.tfevents.*_hparams_folder"))) == 1
    folder = ea.EventAccumulator(str(tmp_path)).Reload()
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        folder.PluginTagToContent("hparams")["_hparams_/experiment"]).experiment
    assert [(info.name, info.differs) for info in experiment.hparam_infos] == [
        ("penalty/weight/gp", True), ("weight", True)]
    assert [info.name.tag for info in experiment.metric_infos] == ["val/loss", "val/acc"]
    # written again (a later sweep into the folder): still one declaration
    declare_folder(tmp_path)
    assert len(list(tmp_path.glob("events.out.tfevents.*_hparams_folder"))) == 1
    assert declare_folder(tmp_path / "run0" / "nothing") == []
    # into a run of its own (no run "." in TensorBoard's lists)
    declare_folder(tmp_path, run="summary")
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    (declaration,) = (tmp_path / "summary").glob("events.out.tfevents.*_hparams_folder")
    content = ea.EventAccumulator(str(declaration.parent)).Reload().PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/experiment"]).experiment
    assert [info.name for info in experiment.hparam_infos] == ["penalty/weight/gp", "weight"]


def test_the_penalty_weight_columns_can_be_left_to_one_weight_column(tmp_path: Path) -> None:
    """``weight_columns=False``: no ``penalty/weight/<path>`` column, blank for runs without
    that penalty; the caller's ``weight`` hyperparameter is the one column."""
    callback = HParamsLogger(["val/acc"], {"weight": 0.0}, weight_columns=False)
    trainer(tmp_path, [callback], limit_val_batches=1).fit(PlainClassifier(lr=0.1), loader(),
                                                            loader())
    assert callback.params["weight"] == 0.0
    assert not [name for name in callback.params if name.startswith("penalty/weight/")]


@pytest.mark.parametrize(("metrics", "kwargs", "message"), [
    ("val/acc", {}, r"metrics must be a list of names, got the string 'val/acc'"),
    ([], {}, "metrics must be a non-empty list of metric names"),
    (["val/acc"], {"ends_after": "validate"}, r"ends_after must be one of \['fit', 'test'\]"),
])
def test_hparams_asks_for_lists(metrics: object, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HParamsLogger(metrics, **kwargs)


def test_hparams_values_are_flattened_for_tensorboard() -> None:
    params = {"model": {"width": 8, "act": None}, "lr": 0.1, "layers": [1, 2], "ok": True}
    assert tensorboard_values(params) == {
        "model/width": 8, "lr": 0.1, "layers": "[1, 2]", "ok": True}


# --- the critic's gradient norm at the interpolates ---------------------------------------------


def test_interpolates_gradient_norm_is_logged_next_to_its_target(tmp_path: Path) -> None:
    module = PlainGan(lr=0.0)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    probe = InterpolatesGradientNorm(critic="discriminator", every_n_steps=2)
    run = trainer(tmp_path, [probe], max_steps=4, log_every_n_steps=2)
    run.fit(module, real_points())
    # a linear critic D(x) = a.x + c has ||grad D|| = ||a|| at every interpolate
    norm = float(module.discriminator.weight.detach().norm())
    assert scalars(run, "interpolates/grad_norm_mean") == {1: pytest.approx(norm, rel=1e-5)}
    assert scalars(run, "interpolates/grad_norm_target") == {1: 1.0}
    (histogram,) = events(run).Histograms("interpolates/grad_norm")
    assert histogram.histogram_value.num == BATCH
    assert histogram.histogram_value.max == pytest.approx(norm, rel=1e-5)
    # its own generator: the training's draws are those of a run without it
    torch.set_rng_state(before)
    plain = trainer(tmp_path / "plain", [], max_steps=4, log_every_n_steps=2)
    plain.fit(PlainGan(lr=0.0), real_points())
    after_probe = torch.get_rng_state()
    torch.set_rng_state(before)
    again = trainer(tmp_path / "again", [InterpolatesGradientNorm(critic="discriminator")],
                    max_steps=4, log_every_n_steps=2)
    again.fit(PlainGan(lr=0.0), real_points())
    assert torch.equal(torch.get_rng_state(), after_probe)


def test_the_target_is_that_of_the_penalty_at_the_interpolates(tmp_path: Path) -> None:
    module = PlainGan(lr=0.0)
    module.gp = r1()  # the norm at the reals towards 0: no target at the interpolates
    run = trainer(tmp_path, [InterpolatesGradientNorm(critic="discriminator")], max_steps=4,
                  log_every_n_steps=2)
    run.fit(module, real_points())
    tags = events(run).Tags()["scalars"]
    assert "interpolates/grad_norm_mean" in tags and "interpolates/grad_norm_target" not in tags
    given = trainer(tmp_path / "given", [InterpolatesGradientNorm(critic="discriminator",
                                                                  target=0.5)],
                    max_steps=4, log_every_n_steps=2)
    given.fit(PlainGan(lr=0.0), real_points())
    assert scalars(given, "interpolates/grad_norm_target") == {1: 0.5}


def test_interpolates_gradient_norm_names_a_missing_attribute(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"InterpolatesGradientNorm needs pl_module.critic to be "
                                         r"the critic \(Module\), but PlainGan.critic is "
                                         r"NoneType; name the attribute with "
                                         r"InterpolatesGradientNorm\(critic='...'\)"):
        trainer(tmp_path, [InterpolatesGradientNorm()]).fit(PlainGan(), real_points())


# --- snapshot ------------------------------------------------------------------------------------


def test_snapshot_draws_the_logged_run(tmp_path: Path) -> None:
    callbacks = [GradientNormMonitor(), SaliencyMaps(4, image_shape=(2, 2))]
    run = fit(tmp_path, PlainClassifier(lr=0.1), callbacks, max_steps=4, limit_val_batches=1)
    figure = dashboards.snapshot({"plain": run.logger.log_dir})

    titles = [ax.get_title() for ax in figure.axes]
    # the charts with data (no empty frames), in the layout's order, then the image
    charts = dashboards.CHARTS
    assert titles == [charts[key][0] for key in (
        "accuracy", "task_loss", "penalty_weighted", "penalty_unweighted", "grad_norm",
        "input_grad", "loss_total", "penalty_weight")] + ["plain: saliency (step 3)"]
    lines = {line.get_label(): line for line in figure.axes[1].lines}
    assert sorted(lines) == ["train/loss"]
    line, logged = lines["train/loss"], scalars(run, "train/loss")  # exactly the logged values
    assert list(line.get_xdata()) == list(logged)
    assert list(line.get_ydata()) == pytest.approx(list(logged.values()))
    path = tmp_path / "dashboard.png"
    figure.savefig(path)
    height, width = imread(path).shape[:2]
    assert (height, width) == (pytest.approx(figure.bbox.height, abs=1),
                               pytest.approx(figure.bbox.width, abs=1))


def test_the_logger_leaves_out_lightnings_epoch_scalar(tmp_path: Path) -> None:
    logger = dashboards.TensorBoardLogger(tmp_path, default_hp_metric=False)
    run = fit(tmp_path, PlainClassifier(), [], logger=logger)
    tags = events(run).Tags()["scalars"]
    assert "train/loss" in tags and "epoch" not in tags
    plain = fit(tmp_path / "plain", PlainClassifier(), [])
    assert "epoch" in events(plain).Tags()["scalars"]  # what Lightning's own logger writes


def test_the_layout_names_unknown_charts() -> None:
    with pytest.raises(ValueError, match=r"unknown charts \['penalties'\]; the charts are"):
        dashboards.custom_scalars_layout(charts=["task_loss", "penalties"])
