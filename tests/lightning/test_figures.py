"""The figures as TensorBoard gets them: saliency maps, a critic's landscape, sample grids,
their titles and the autograd graph's layers, checked against closed forms."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.image import imread
from torch import Tensor, nn

from gradreg.graph import GraphEdge, autograd_graph, collapse_module_calls
from gradreg.lightning import dashboards
from gradreg.lightning.callbacks import (
    AutogradGraphLogger,
    CriticLandscape,
    SaliencyMaps,
    SampleGrid,
)
from gradreg.lightning.callbacks import figures as figures_module
from gradreg.lightning.callbacks import samples as samples_module
from gradreg.lightning.callbacks.graph_figure import CARD_WIDTH, graph_figure, layers
from tests.lightning.helpers import (
    BATCH,
    WEIGHT,
    ManualClassifier,
    PlainClassifier,
    PlainGan,
    data,
    events,
    fit,
    hand_input_gradients,
    real_points,
    trainer,
)


def record_calls(monkeypatch: pytest.MonkeyPatch, name: str, module: Any = figures_module
                 ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Record the arguments of every call of ``<module>.<name>`` (still drawing the figure)."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    draw = getattr(module, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return draw(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return calls


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
                           "scale": f"scale of this run's first figure [0, "
                                    f"{float(expected.max()):.2g}]",
                           "title": f"step {step} · λ = {WEIGHT}"}


def test_a_fixed_saliency_scale_is_the_same_for_every_run_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs, one at twice the other's input weights: on the fixed scale [0, 0.2] the second's
    maps are twice as bright, where each run's own first-figure scale would draw them alike."""
    calls = record_calls(monkeypatch, "saliency_figure")
    for index, factor in enumerate((1.0, 2.0)):
        module = PlainClassifier()
        with torch.no_grad():
            module.net.weight.mul_(factor)
        fit(tmp_path / str(index), module,
            [SaliencyMaps(5, image_shape=(2, 2), every_n_steps=100, vmax=0.2)], max_steps=1,
            limit_val_batches=1)
    (first, first_options), (second, second_options) = calls
    assert first_options["vmax"] == second_options["vmax"] == 0.2
    assert first_options["scale"] == "fixed scale [0, 0.2]"
    # |W^T (softmax - e_y)| is not linear in W, but larger everywhere at the doubled weights
    assert second[1].max() > first[1].max()


def test_the_saliency_figure_states_its_scale_and_clips_above_it() -> None:
    figure = dashboards.saliency_figure(np.zeros((2, 2, 2)), np.full((2, 2, 2), 0.3), [0, 1],
                                        vmax=0.2, scale="fixed scale [0, 0.2]")
    bar = figure.axes[-1]
    assert "fixed scale [0, 0.2]" in bar.get_ylabel()
    assert bar.get_ylim()[1] == pytest.approx(0.2)
    # each map's norm under it: sqrt(4 * 0.3^2) = 0.6
    assert [ax.get_xlabel() for ax in figure.axes[1:4:2]] == ["0.6", "0.6"]


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


@pytest.mark.parametrize("vmax", [0, -1.0, float("nan"), "0.5"])
def test_saliency_maps_reject_a_bad_scale(vmax: object) -> None:
    with pytest.raises(ValueError, match="vmax must be a finite number > 0"):
        SaliencyMaps(vmax=vmax)


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


# --- sample grids ------------------------------------------------------------------------------


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
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_calls(monkeypatch, "samples_figure", samples_module)
    module = ImageGenerator()
    run = fit(tmp_path, module, [SampleGrid(4, every_n_steps=every)])
    images = events(run).Images("samples")
    assert [image.step for image in images] == steps
    # the grid of G(z) for the seeded latents, each 2x2 image drawn as it is, titled with the
    # step (the module has no penalty: no λ)
    latents = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    expected = module.generator(latents).detach()[:, 0].numpy()
    for step, ((shown,), options) in zip(steps, calls, strict=True):
        np.testing.assert_allclose(shown, expected, atol=1e-6)
        assert options == {"title": f"step {step}"}
    assert imread(io.BytesIO(images[-1].encoded_image_string)).shape[2] in (3, 4)


def test_a_sample_grid_leaves_gaps_between_the_images() -> None:
    """Four one-pixel black images on a white page: between neighbours there is white."""
    figure = dashboards.samples_figure(np.zeros((4, 1, 1)), title="step 3 · λ = 0.1", columns=4)
    boxes = sorted(ax.get_position().x0 for ax in figure.axes)
    widths = [ax.get_position().width for ax in figure.axes]
    gaps = [right - (left + width) for left, right, width in zip(boxes, boxes[1:], widths,
                                                                 strict=False)]
    assert all(gap > 0.01 for gap in gaps)
    assert figure.texts[0].get_text() == "step 3 · λ = 0.1"


# --- titles and the graph's layers --------------------------------------------------------------


def test_figure_titles_say_the_step_and_every_weight() -> None:
    assert dashboards.figure_title(7, {}) == "step 7"
    assert dashboards.figure_title(7, {"penalties.gp": 0.1}) == "step 7 · λ = 0.1"
    assert dashboards.figure_title(7, {"penalties.r1": 10.0, "penalties.r2": 1.0}) == (
        "step 7 · λ r1 = 10, r2 = 1")


def test_graph_layers_put_every_node_below_all_its_parents() -> None:
    """0 -> 1 -> 3, 0 -> 2 -> 3, 0 -> 3 and 3 -> 4: node 3's longest path from 0 has 2 edges."""
    edges = [GraphEdge(s, t, 0, k) for k, (s, t) in enumerate(
        [(0, 1), (0, 2), (0, 3), (1, 3), (2, 3), (3, 4)])]
    assert layers(5, edges) == [[0], [1, 2], [3], [4]]


def test_the_graph_picture_is_legible_at_tensorboards_card_width() -> None:
    """TensorBoard's Images tab draws an image 350 px wide (nearest-neighbour: a picture twice
    as wide and even in height loses every other pixel row and column, no letter is cut
    unevenly): every text of the picture must be >= 10 px there, i.e. fontsize * dpi / 72 *
    350 / (width in px) >= 10; a layer of 12 wide boxes wraps onto rows, and no two boxes
    overlap or leave the picture once drawn."""
    long = "encoder.layers.11.self_attn.out_proj (NonDynamicallyQuantizableLinear)"  # 70
    labels = ["AddBackward0"] + [f"layer{k}.fc (Linear)" for k in range(11)] + [long, "x"]
    kinds = ["forward"] + ["module"] * 12 + ["leaf"]
    edges = [GraphEdge(0, k, 0, k) for k in range(1, 13)] + [
        GraphEdge(k, 13, 0, 12 + k) for k in range(1, 13)]
    figure = graph_figure(labels, kinds, edges, title="backward graph of the loss, step 0:\n"
                          "14 nodes (0 double backward) in 14 boxes")
    width_px = figure.get_figwidth() * figure.dpi
    assert CARD_WIDTH == 350 and width_px == 2 * CARD_WIDTH  # pixels kept: every other
    assert round(figure.get_figheight() * figure.dpi) % 2 == 0
    texts = [*figure.axes[0].texts, *figure.legends[0].get_texts(), *figure.texts]
    assert min(t.get_fontsize() * figure.dpi / 72 * CARD_WIDTH / width_px for t in texts) >= 10
    canvas = FigureCanvasAgg(figure)  # as TensorBoard's add_figure draws it
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [t.get_bbox_patch().get_window_extent(renderer) for t in figure.axes[0].texts]
    assert len(boxes) == 14 and len({round(b.y0) for b in boxes}) >= 5  # the 12 wrapped
    assert figure.axes[0].texts[12].get_text() == (
        "encoder.layers.11.self_at…micallyQuantizableLinear)")  # 51 characters
    assert not [(a, b) for k, a in enumerate(boxes) for b in boxes[k + 1:] if a.overlaps(b)]
    assert all(b.x0 >= 0 and b.x1 <= width_px and b.y0 >= 0 for b in boxes)
    header = [t.get_window_extent(renderer) for t in texts[14:]]
    assert all(h.x1 <= width_px and h.y0 > max(b.y1 for b in boxes) for h in header)


def test_the_logged_graph_picture_draws_the_module_calls_as_boxes(tmp_path: Path) -> None:
    """The logger's picture of a Linear classifier's double-backprop loss is the figure of the
    collapsed graph (its pixel size says how many rows it has): the Addmm of ``net`` with the T
    of its weight and the leaves of weight and bias one box ``net (Linear)``, so the graph's 18
    nodes are 15 boxes."""
    module = ManualClassifier()  # backpropagates its loss as it is (no division by Lightning)
    run = fit(tmp_path, module, [AutogradGraphLogger()], max_steps=1)
    (image,) = events(run).Images("graph/autograd")
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        loss = module.loss(*data())  # lr=0: the graph of the logged step
    graph = autograd_graph(loss, dict(module.named_parameters()))
    boxes = collapse_module_calls(graph, {"net": "Linear"})
    assert (len(graph.nodes), len(boxes.labels)) == (18, 15) and "net (Linear)" in boxes.labels
    expected = graph_figure(boxes.labels, boxes.kinds, boxes.edges, title="one\ntwo")
    assert (image.width, image.height) == (700, round(expected.get_figheight() * expected.dpi))


def test_the_critic_landscape_shows_clipping_and_counts_the_fakes_outside() -> None:
    """A gradient norm of 3 on the scale [0, 2]: the colour bar gets its arrow at the top; two of
    three fakes lie outside the plane drawn, and the legend says so."""
    axis = np.linspace(-1.0, 1.0, 3)
    field = np.full((3, 3), 3.0)
    fake = np.array([[0.0, 0.0], [5.0, 0.0], [0.0, -7.0]])
    figure = dashboards.critic_landscape_figure(axis, axis, field, np.zeros((1, 2)), fake,
                                                kind="grad_norm", vmin=0.0, vmax=2.0)
    (image,) = figure.axes[0].images
    assert image.colorbar.extend == "max"
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert legend == ["real", "fake (2 outside)"]
    within = dashboards.critic_landscape_figure(axis, axis, np.ones((3, 3)), np.zeros((1, 2)),
                                                fake[:1], kind="grad_norm", vmin=0.0, vmax=2.0)
    assert within.axes[0].images[0].colorbar.extend == "neither"
