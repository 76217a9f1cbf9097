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
from torch.utils.data import DataLoader

from gradreg.lightning import dashboards
from gradreg.lightning.callbacks import (
    CriticLandscape,
    CustomScalarsLayout,
    GradientNormMonitor,
    HParamsLogger,
    PenaltyWeightSchedule,
    SaliencyMaps,
)
from gradreg.lightning.callbacks import figures as figures_module
from gradreg.lightning.callbacks.hparams import tensorboard_values
from gradreg.penalties import interpolate, wgan_gp
from tests.lightning.test_callbacks import (
    BATCH,
    WEIGHT,
    PlainClassifier,
    data,
    events,
    fit,
    hand_input_gradients,
    loader,
    scalars,
    trainer,
)


def record_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[Any, ...]]:
    """Record the arguments of every call of ``figures.<name>`` (still drawing the figure)."""
    calls: list[tuple[Any, ...]] = []
    draw = getattr(figures_module, name)

    def recording(*args: Any) -> Any:
        calls.append(args)
        return draw(*args)

    monkeypatch.setattr(figures_module, name, recording)
    return calls


# --- custom scalars ------------------------------------------------------------------------------


def test_layout_is_logged_and_every_chart_matches_logged_tags(tmp_path: Path) -> None:
    callbacks = [CustomScalarsLayout(), GradientNormMonitor(), PenaltyWeightSchedule(steps=2)]
    run = fit(tmp_path, PlainClassifier(), callbacks)
    accumulator = events(run)
    # As TensorBoard's plugin reads it: the tag is the plugin's, the layout is the tensor.
    assert list(accumulator.PluginTagToContent("custom_scalars")) == ["custom_scalars__config__"]
    (event,) = accumulator.Tensors("custom_scalars__config__")
    (category,) = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0]).category
    assert category.title == "gradreg"
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    assert charts == {
        "task loss": [r".*loss.*"],
        "penalties": [r"(.*/)?penalty/.*"],
        "penalty weights": [r"penalty_weight/.*"],
        "parameter gradient norm (total)": [r"grad_.*_norm_total.*"],
        "input gradient norm": [r"input_grad/norm_(mean|max)"],
    }
    tags = accumulator.Tags()["scalars"]
    matched = {title: sorted(t for t in tags if any(re.match(r, t) for r in regexes))
               for title, regexes in charts.items()}
    assert matched == {
        "task loss": ["train/loss"],
        "penalties": ["penalty/gp"],
        "penalty weights": ["penalty_weight/gp"],
        "parameter gradient norm (total)": ["grad_2.0_norm_total"],
        "input gradient norm": ["input_grad/norm_max", "input_grad/norm_mean"],
    }


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


def test_hparams_are_logged_with_final_metrics(tmp_path: Path) -> None:
    module = PlainClassifier(weight=WEIGHT, lr=0.1)
    run = fit(tmp_path, module, [HParamsLogger(["val/acc", "test/acc"], {"sweep": "a"})],
              limit_val_batches=1)
    run.test(module, loader())

    start = hparams_plugin_data(run, "session_start_info").session_start_info
    assert start.hparams["weight"].number_value == WEIGHT
    assert start.hparams["lr"].number_value == 0.1
    assert start.hparams["penalty_weight/gp"].number_value == WEIGHT
    assert start.hparams["sweep"].string_value == "a"
    experiment = hparams_plugin_data(run, "experiment").experiment
    assert [info.name.tag for info in experiment.metric_infos] == ["hp/val/acc", "hp/test/acc"]

    # The tab shows the latest value of each metric tag: val/acc's at fit end, test/acc's.
    val_acc = scalars(run, "val/acc")
    assert scalars(run, "hp/val/acc") == {3: pytest.approx(val_acc[max(val_acc)])}
    test_acc = float(run.callback_metrics["test/acc"])
    assert scalars(run, "hp/test/acc") == {3: pytest.approx(test_acc)}


@pytest.mark.parametrize("metrics", ["val/acc", []])
def test_hparams_asks_for_a_list_of_metrics(metrics: object) -> None:
    with pytest.raises(ValueError, match="metrics must be a non-empty list of metric names"):
        HParamsLogger(metrics)


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
    # lr = 0: each figure shows |W^T (softmax - e_y)| of the first 5 validation samples.
    expected = hand_input_gradients(module.net.weight, module.net.bias).detach()[:5].abs()
    for images_shown, saliency, labels in calls:
        np.testing.assert_allclose(saliency, expected.reshape(5, 2, 2).numpy(), atol=1e-6)
        assert labels == data()[1][:5].tolist()
        assert images_shown.min() == 0.0 and images_shown.max() == 1.0  # each image rescaled


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


class PlainGan(pl.LightningModule):
    """A 2D WGAN-GP written by a user; ``discriminator`` instead of the default ``critic``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.latent_dim = 3
        self.generator = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 2))
        self.discriminator = nn.Linear(2, 1)  # linear: D(x) = a.x + c, ||grad D|| = ||a||
        self.gp = wgan_gp()

    def training_step(self, real: Tensor, batch_idx: int) -> None:
        critic_optimizer, generator_optimizer = self.optimizers()
        fake = self.generator(torch.randn(len(real), self.latent_dim))
        points = interpolate(real, fake)
        critic_loss = (self.discriminator(fake.detach()).mean() - self.discriminator(real).mean()
                       + self.gp(self.discriminator(points).squeeze(1), points))
        critic_optimizer.zero_grad()
        self.manual_backward(critic_loss)
        critic_optimizer.step()
        generator_optimizer.zero_grad()
        self.manual_backward(-self.discriminator(fake).mean())
        generator_optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.discriminator.parameters(), lr=1e-2),
                torch.optim.Adam(self.generator.parameters(), lr=1e-2)]


def real_points() -> DataLoader:
    return DataLoader(torch.randn(4 * BATCH, 2, generator=torch.Generator().manual_seed(1)),
                      batch_size=BATCH)


def test_critic_landscape_shows_scores_and_gradient_norms(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_calls(monkeypatch, "critic_landscape_figure")
    module = PlainGan()
    landscape = CriticLandscape(critic="discriminator", num_fake=32, resolution=8,
                                extent=(-2.0, 2.0, -1.0, 3.0))
    run = trainer(tmp_path, [landscape], max_steps=4, log_every_n_steps=2)
    run.fit(module, real_points())

    # Manual optimization, two optimizers a batch: Lightning logs batch 1 at step 1.
    assert [image.step for image in events(run).Images("critic_landscape")] == [1]
    ((xs, ys, scores, norms, real, fake),) = calls
    np.testing.assert_allclose(xs, np.linspace(-2, 2, 8), rtol=1e-6)
    np.testing.assert_allclose(ys, np.linspace(-1, 3, 8), rtol=1e-6)
    a, c = module.discriminator.weight.detach()[0].numpy(), module.discriminator.bias.item()
    grid_x, grid_y = np.meshgrid(xs, ys)
    np.testing.assert_allclose(scores, a[0] * grid_x + a[1] * grid_y + c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norms, np.full((8, 8), np.linalg.norm(a)), rtol=1e-5)
    assert real.shape == (BATCH, 2) and fake.shape == (32, 2)


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
    assert titles[:5] == ["task loss", "penalties", "penalty weights",
                          "parameter gradient norm (total)", "input gradient norm"]
    assert titles[5] == "plain: saliency (step 3)"
    lines = {line.get_label(): line for line in figure.axes[0].lines}
    assert sorted(lines) == ["train/loss", "val/loss"]
    line, logged = lines["train/loss"], scalars(run, "train/loss")  # exactly the logged values
    assert list(line.get_xdata()) == list(logged)
    assert list(line.get_ydata()) == pytest.approx(list(logged.values()))
    path = tmp_path / "dashboard.png"
    figure.savefig(path)
    height, width = imread(path).shape[:2]
    assert (height, width) == (pytest.approx(figure.bbox.height, abs=1),
                               pytest.approx(figure.bbox.width, abs=1))
