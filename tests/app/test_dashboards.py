"""The dashboards as a person sees them: a two-run sweep of the real entry point (no penalty vs
double backprop, ``callbacks=dashboards``) and a WGAN-GP run (``callbacks=gan_dashboards``) in one
log folder, served by a real TensorBoard. Its data API and the event files say what each run has;
where Debian's ``chromium`` is installed a headless browser renders every tab and the test reads
them. With ``GRADREG_SCREENSHOTS=<folder>`` the browser also saves each tab there (the
``docs/dashboard*.png`` pictures are made so)."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from pathlib import Path

import pytest
from tensorboard.backend.event_processing import event_accumulator as ea

from tests.app.browser import Chromium, executable
from tests.tensorboard_server import poll

from .helpers import run_script

# the module's runs of the app (a sweep and a GAN run), shared by its tests (~16 s)
pytestmark = pytest.mark.slow
# the runs are named after what their command line changed: which run had which penalty
SWEEP = ["0_penalty:none/tensorboard", "1_penalty:double_backprop/tensorboard"]
GAN_OVERRIDES = ["experiment=gan_8gaussians_wgan_gp", "data.n_train=5120", "data.n_val=256",
                 "data.n_test=256", "trainer.max_epochs=1"]
CLASSIFIER_METRICS = ["val/acc", "val/acc_pgd", "test/acc", "test/acc_fgsm", "test/acc_pgd",
                      "test/input_grad_norm"]
GAN_METRICS = ["val/energy_distance", "test/energy_distance", "test/wasserstein", "test/modes",
               "test/high_quality", "test/kl", "test/feature_energy_distance"]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``-m penalty=none,double_backprop callbacks=dashboards`` (20 steps per run) and a
    20-batch WGAN-GP run on 8 Gaussians, in one folder."""
    root = tmp_path_factory.mktemp("logs")
    sweep = run_script("-m", "penalty=none,double_backprop", "callbacks=dashboards",
                       "trainer.max_epochs=1", "+trainer.limit_train_batches=20",
                       "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1",
                       "trainer.log_every_n_steps=2", "callbacks.saliency.every_n_steps=10",
                       "model.pgd_steps=2", "trainer.enable_progress_bar=false",
                       f"hydra.sweep.dir={root}")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    gan = run_script(*GAN_OVERRIDES, "trainer.enable_progress_bar=false", f"paths.runs={root}")
    assert gan.returncode == 0, gan.stderr[-3000:]
    return root


def run_names(root: Path) -> list[str]:
    """The TensorBoard run names: the folders holding event files, relative to the log folder."""
    return sorted({path.parent.relative_to(root).as_posix()
                   for path in root.rglob("events.out.tfevents.*")})


def event_file(root: Path, run: str) -> ea.EventAccumulator:
    accumulator = ea.EventAccumulator(str(root / run), size_guidance={ea.SCALARS: 0})
    return accumulator.Reload()


def hparams_request(url: str, what: str, body: dict) -> dict:
    """The HParams plugin's answer, as the page asks for it (POST)."""
    request = urllib.request.Request(f"{url}/data/plugin/hparams/{what}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.load(response)


def test_the_runs_are_named_after_their_overrides(logs: Path) -> None:
    names = run_names(logs)
    assert names[:2] == SWEEP
    (gan,) = names[2:]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d_data\.n_test:256\+data\.n_train:5120"
                        r"\+data\.n_val:256\+experiment:gan_8gaussians_wgan_gp"
                        r"\+trainer\.max_epochs:1/tensorboard", gan), gan


def test_the_event_files_hold_one_tag_scheme_for_both_kinds(logs: Path) -> None:
    _, double_backprop, gan = (event_file(logs, run) for run in run_names(logs))
    classifier_tags, gan_tags = double_backprop.Tags(), gan.Tags()
    # lambda every logged step, without a schedule: 20 steps, logged every 2
    weights = double_backprop.Scalars("penalty/weight/penalties.double_backprop")
    assert [(e.step, e.value) for e in weights] == [(s, pytest.approx(0.1))
                                                    for s in range(1, 20, 2)]
    gan_weights = [e.value for e in gan.Scalars("penalty/weight/penalties.wgan_gp")]
    assert gan_weights == [pytest.approx(0.1)] * len(gan_weights) and gan_weights
    for tags, owners in ((classifier_tags, [""]), (gan_tags, ["/critic", "/generator"])):
        assert {f"{kind}/total{owner}" for kind in ("loss", "grad_norm") for owner in owners} <= (
            set(tags["scalars"]))
        assert "epoch" not in tags["scalars"]
        assert not [tag for tag in tags["scalars"] if tag.startswith(("hp/", "grad_2"))]
    assert set(classifier_tags["histograms"]) == {
        "input_grad/norm", "param_grad/backbone.fc1", "param_grad/backbone.fc2",
        "param_grad/backbone.out"}
    assert {"interpolates/grad_norm", "param_grad/critic.fc1",
            "param_grad/generator.fc1"} <= set(gan_tags["histograms"])
    assert [e.value for e in gan.Scalars("interpolates/grad_norm_target")] == [1.0, 1.0]
    assert set(classifier_tags["images"]) == {"saliency", "graph/autograd"}
    assert set(gan_tags["images"]) == {"critic_landscape/score", "critic_landscape/grad_norm",
                                       "graph/autograd"}
    # the critic landscape's interval (200 steps) is longer than the run: its last image
    assert [image.step for image in gan.Images("critic_landscape/grad_norm")] == [19]


def test_tensorboard_serves_every_dashboard_and_one_hparams_table(logs: Path, serve) -> None:
    url = serve(logs)
    names = run_names(logs)
    assert poll(f"{url}/data/runs", lambda runs: len(runs) == 3) == names
    plugins = poll(f"{url}/data/plugins_listing",
                   lambda listing: listing.get("hparams", {}).get("enabled"))
    for plugin in ("scalars", "custom_scalars", "images", "text", "hparams", "histograms"):
        assert plugins[plugin]["enabled"], plugin
    text = poll(f"{url}/data/plugin/text/tags", lambda tags: len(tags) == 3)
    assert all(set(text[run]) == {"autograd_graph/text/text_summary",
                                  "autograd_graph/dot/text_summary"} for run in names)
    experiment = hparams_request(url, "experiment", {"experimentName": ""})
    infos = {info["name"]: info.get("differs", False) for info in experiment["hparamInfos"]}
    assert {"penalty", "weight", "lr", "generator_lr", "hidden", "activation", "n_critic",
            "loss", "batch_size", "max_epochs", "seed"} <= set(infos)
    assert sorted(name for name, shown in infos.items() if shown) == [
        "batch_size", "lr", "penalty", "seed", "weight"]
    metrics = [info["name"]["tag"] for info in experiment["metricInfos"]]
    assert metrics == CLASSIFIER_METRICS + GAN_METRICS
    # every run, of either kind, has its lr, batch size and weight in the one table
    groups = hparams_request(url, "session_groups", {
        "experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS"],
        "colParams": [{"hparam": name} for name in ("lr", "batch_size", "weight")],
        "startIndex": 0, "sliceSize": 10})
    rows = {group["name"]: group["hparams"] for group in groups["sessionGroups"]}
    assert {name: (row["lr"], row["batch_size"], row["weight"]) for name, row in rows.items()
            } == dict(zip(names, [(0.001, 64, 0.0), (0.001, 64, 0.1), (0.0001, 256, 0.1)],
                          strict=True))


# what each tab must show once rendered
TABS = {
    # Time Series opens on the parameter gradient norms, not on an epoch chart
    "timeseries": [*SWEEP, "grad_norm 3 cards", "grad_norm/total /critic", "graph 3 cards"],
    "custom_scalars": [*SWEEP, "task loss (train)", "loss + penalty (train)",
                       "penalties, unweighted P", "penalties, weighted", "penalty weights λ",
                       "penalty/weight/penalties.double_backprop (1_penalty:double_backprop",
                       "penalty/weight/penalties.wgan_gp (2026",
                       "critic gradient norm ‖∇D(x̂)‖ at interpolates"],
    "hparams": ["TABLE VIEW", *SWEEP, "batch_size", "lr", "weight", "penalty", "none",
                "double_backprop", "wgan_gp", "0.0010000", "0.00010000", "64.000", "256.00",
                "Number of matching session groups: 3"],
    "images": [*SWEEP, "graph/autograd", "critic_landscape/grad_norm", "saliency"],
    # one card per layer: 3 for each classifier, 4 for each of the GAN's networks
    "histograms": [*SWEEP, "param_grad 14", "interpolates/grad_norm", "input_grad/norm"],
    "histograms&tagFilter=param_grad": ["param_grad/backbone.fc1", "param_grad/critic.fc1"],
    "text": [*SWEEP, "autograd_graph/text/text_summary", "NllLossBackward0"],
}
# the tabs whose screenshots are the documentation's pictures
SCREENSHOTS = {"custom_scalars": "dashboard.png", "hparams": "dashboard_hparams.png",
               "images": "dashboard_images.png",
               "histograms&tagFilter=param_grad": "dashboard_histograms.png"}


@pytest.mark.skipif(executable() is None,
                    reason="needs a browser: Debian's chromium (apt-get install chromium)")
def test_the_tabs_render_in_a_browser(logs: Path, serve, tmp_path: Path) -> None:
    url = serve(logs)
    shots = Path(os.environ.get("GRADREG_SCREENSHOTS", tmp_path))
    browser = Chromium(tmp_path / "profile", width=1400, height=1000)
    try:
        for tab, needles in TABS.items():
            browser.open(f"{url}/#{tab}")
            text = browser.wait_for_text(*needles)
            if tab == "timeseries":
                assert "epoch" not in text.split()
            if tab in SCREENSHOTS:
                time.sleep(2)  # the charts' drawing animations
                browser.screenshot(shots / SCREENSHOTS[tab])
    finally:
        browser.close()
