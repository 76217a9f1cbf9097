"""Dashboards as a user sees them: layout, HParams, figures and the snapshot, read from events."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from matplotlib.image import imread
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2
from torch import Tensor, nn

from gradreg.lightning import dashboards
from gradreg.lightning.callbacks import (
    CriticLandscape,
    CustomScalarsLayout,
    GradientNormMonitor,
    HParamsLogger,
    InterpolatesGradientNorm,
    PenaltyWeightSchedule,
    SaliencyMaps,
    SampleGrid,
)
from gradreg.lightning.callbacks import figures as figures_module
from gradreg.lightning.callbacks.hparams import tensorboard_values
from tests.lightning.helpers import (
    BATCH,
    WEIGHT,
    PlainClassifier,
    PlainGan,
    data,
    events,
    fit,
    hand_input_gradients,
    loader,
    real_points,
    scalars,
    trainer,
)


def record_calls(monkeypatch: pytest.MonkeyPatch, name: str
                 ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Record the arguments of every call of ``figures.<name>`` (still drawing the figure)."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    draw = getattr(figures_module, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return draw(*args, **kwargs)

    monkeypatch.setattr(figures_module, name, recording)
    return calls


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
    callbacks = [CustomScalarsLayout(), GradientNormMonitor(), PenaltyWeightSchedule(steps=2)]
    run = fit(tmp_path, PlainClassifier(), callbacks, limit_val_batches=1)
    charts = layout_charts(run)
    # weighted and unweighted penalties in charts of their own; the task loss of training only
    assert matched(run, charts) == {
        "task loss (train)": ["train/loss"],
        "loss + penalty (train): what is backpropagated": ["loss/total"],
        "penalties, unweighted P": ["penalty/unweighted/gp"],
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
    assert matched(gan, theirs)["penalties, unweighted P"] == ["penalty/unweighted/gp"]
    assert matched(gan, theirs)["loss + penalty (train): what is backpropagated"] == [
        "loss/total/discriminator", "loss/total/generator"]


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


def test_hparams_are_declared_with_default_columns_and_the_metrics_own_tags(tmp_path: Path
                                                                            ) -> None:
    module = PlainClassifier(weight=WEIGHT, lr=0.1)
    logger = HParamsLogger(["val/acc", "test/acc"], {"sweep": "a"}, columns=["lr", "n_critic"])
    run = fit(tmp_path, module, [logger], limit_val_batches=1)
    run.test(module, loader())

    start = hparams_plugin_data(run, "session_start_info").session_start_info
    assert start.hparams["weight"].number_value == WEIGHT
    assert start.hparams["lr"].number_value == 0.1
    assert start.hparams["penalty_weight/gp"].number_value == WEIGHT
    assert start.hparams["sweep"].string_value == "a"
    experiment = hparams_plugin_data(run, "experiment").experiment
    assert [info.name.tag for info in experiment.metric_infos] == ["val/acc", "test/acc"]
    # the columns are declared (n_critic although this run has none) and marked to be shown
    infos = {info.name: info.differs for info in experiment.hparam_infos}
    assert infos == {"lr": True, "n_critic": True, "weight": False,
                     "penalty_weight/gp": False, "sweep": False}
    # the table's values are the metrics' own latest scalars; nothing is logged twice
    tags = events(run).Tags()["scalars"]
    assert not [tag for tag in tags if tag.startswith("hp")]
    assert {"val/acc", "test/acc"} <= set(tags)


@pytest.mark.parametrize(("metrics", "columns", "message"), [
    ("val/acc", (), r"metrics must be a list of names, got the string 'val/acc'"),
    ([], (), "metrics must be a non-empty list of metric names"),
    (["val/acc"], "lr", r"write columns=\['lr'\]"),
])
def test_hparams_asks_for_lists(metrics: object, columns: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HParamsLogger(metrics, columns=columns)


def test_hparams_values_are_flattened_for_tensorboard() -> None:
    params = {"model": {"width": 8, "act": None}, "lr": 0.1, "layers": [1, 2], "ok": True}
    assert tensorboard_values(params) == {
        "model/width": 8, "model/act": "None", "lr": 0.1, "layers": "[1, 2]", "ok": True}


# --- saliency maps -------------------------------------------------------------------------------


def test_saliency_maps_show_the_input_gradient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    calls = record_calls(monkeypatch, "saliency_figure")
    module = PlainClassifier()
    run = fit(tmp_path, module, [SaliencyMaps(5, image_shape=(2, 2), every_n_steps=2)],
              max_steps=4, limit_val_batches=1)

    images = events(run).Images("saliency")
    assert [image.step for image in images] == [1, 3]
    assert imread(io.BytesIO(images[0].encoded_image_string)).shape[2] in (3, 4)
    # lr = 0: each figure shows |W^T (softmax - e_y)| of the first 5 validation samples, on
    # the colour scale of the first figure, with the step and the weight in its title.
    expected = hand_input_gradients(module.net.weight, module.net.bias).detach()[:5].abs()
    for step, ((images_shown, saliency, labels), options) in zip((1, 3), calls, strict=True):
        np.testing.assert_allclose(saliency, expected.reshape(5, 2, 2).numpy(), atol=1e-6)
        assert labels == data()[1][:5].tolist()
        assert images_shown.min() == 0.0 and images_shown.max() == 1.0  # each image rescaled
        assert options == {"vmax": pytest.approx(float(expected.max())),
                           "title": f"step {step} · λ = {WEIGHT}"}


def test_a_run_shorter_than_the_interval_logs_a_last_figure(tmp_path: Path) -> None:
    run = fit(tmp_path, PlainClassifier(), [SaliencyMaps(2, image_shape=(2, 2),
                                                         every_n_steps=100)],
              max_steps=3, limit_val_batches=1)
    assert [image.step for image in events(run).Images("saliency")] == [2]


def test_saliency_maps_ask_for_the_image_shape_of_flat_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"pass image_shape=\(H, W\) or \(C, H, W\)"):
        fit(tmp_path, PlainClassifier(), [SaliencyMaps()], limit_val_batches=1)


def test_saliency_maps_check_the_image_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"image_shape=\(3, 3\) has 9 values, but one input has 4"):
        fit(tmp_path, PlainClassifier(), [SaliencyMaps(image_shape=(3, 3))], limit_val_batches=1)


def test_saliency_maps_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="num_images must be an int >= 1"):
        SaliencyMaps(0)
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
        SaliencyMaps(every_n_steps=-3)


# --- critic landscape ----------------------------------------------------------------------------


def test_critic_landscape_shows_scores_and_gradient_norms(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_calls(monkeypatch, "critic_landscape_figure")
    module = PlainGan(lr=0.0)
    landscape = CriticLandscape(critic="discriminator", num_fake=32, resolution=8,
                                extent=(-2.0, 2.0, -1.0, 3.0))
    run = trainer(tmp_path, [landscape], max_steps=8, log_every_n_steps=2,
                  limit_train_batches=4, max_epochs=1)
    run.fit(module, real_points())

    # Manual optimization, two optimizers a batch: Lightning logs batch 1 at step 1, and the
    # last batch (step 3) at the end of training.
    for kind in ("score", "grad_norm"):
        assert [image.step for image in events(run).Images(f"critic_landscape/{kind}")] == [1, 3]
    (((xs, ys, scores, real, fake), score_options), ((_, _, norms, _, _), norm_options),
     *_) = calls
    np.testing.assert_allclose(xs, np.linspace(-2, 2, 8), rtol=1e-6)
    np.testing.assert_allclose(ys, np.linspace(-1, 3, 8), rtol=1e-6)
    # lr = 0 (the module keeps its weights): D(x) = a.x + c, ||grad D|| = ||a||
    a, c = module.discriminator.weight.detach()[0].numpy(), module.discriminator.bias.item()
    grid_x, grid_y = np.meshgrid(xs, ys)
    np.testing.assert_allclose(scores, a[0] * grid_x + a[1] * grid_y + c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norms, np.full((8, 8), np.linalg.norm(a)), rtol=1e-5)
    assert real.shape == (BATCH, 2) and fake.shape == (32, 2)
    # fixed scales: the norm's [0, 2]; the scores' half-width from the first frame
    assert (norm_options["vmin"], norm_options["vmax"]) == (0.0, 2.0)
    half_width = np.abs(scores - np.median(scores)).max()
    assert score_options["vmax"] - score_options["vmin"] == pytest.approx(2 * half_width)
    assert score_options["title"] == "step 1 · λ = 10"


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


def test_critic_landscape_names_a_missing_attribute(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs pl_module.critic to be the critic \(Module\), "
                                         r"but PlainGan.critic is NoneType; name the attribute "
                                         r"with CriticLandscape\(critic='...'\)"):
        trainer(tmp_path, [CriticLandscape()]).fit(PlainGan(), real_points())


def test_critic_landscape_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match=r"extent must be \(xmin, xmax, ymin, ymax\)"):
        CriticLandscape(extent=(1.0, 0.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="resolution must be >= 2"):
        CriticLandscape(resolution=1)


# --- snapshot ------------------------------------------------------------------------------------


def test_snapshot_draws_the_logged_run(tmp_path: Path) -> None:
    callbacks = [GradientNormMonitor(), SaliencyMaps(4, image_shape=(2, 2))]
    run = fit(tmp_path, PlainClassifier(lr=0.1), callbacks, max_steps=4, limit_val_batches=1)
    figure = dashboards.snapshot({"plain": run.logger.log_dir})

    titles = [ax.get_title() for ax in figure.axes]
    assert titles[:8] == [title for title, _ in dashboards.CHARTS.values()]
    assert titles[8] == "plain: saliency (step 3)"
    lines = {line.get_label(): line for line in figure.axes[0].lines}
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


class ImageGenerator(pl.LightningModule):
    """A generator of 2x2 gray images, trained on nothing (lr = 0): its samples never change."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.latent_dim = 3
        self.generator = nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Unflatten(1, (1, 2, 2)))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.generator(torch.randn(len(batch), self.latent_dim)).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize(("every", "steps"), [(1, [0, 1, 2]), (2, [1, 2]), (100, [2])])
def test_sample_grids_at_the_interval_and_at_the_end(every: int, steps: list[int],
                                                     tmp_path: Path) -> None:
    module = ImageGenerator()
    run = fit(tmp_path, module, [SampleGrid(4, every_n_steps=every)])
    images = events(run).Images("samples")
    assert [image.step for image in images] == steps
    # the grid of G(z) for the seeded latents, as 8-bit gray levels
    latents = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    expected = (module.generator(latents).detach() * 255).round()
    grid = imread(io.BytesIO(images[-1].encoded_image_string), format="png")
    assert grid.shape[:2] == (2, 8)  # one row of four 2x2 images
    tiles = [grid[:, c:c + 2, 0] for c in (0, 2, 4, 6)]
    np.testing.assert_allclose(np.stack(tiles) * 255, expected[:, 0].numpy(), atol=1.0)
