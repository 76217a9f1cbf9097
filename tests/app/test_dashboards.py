"""The dashboards as a person sees them: a two-run sweep of the real entry point (no penalty vs
double backprop, ``callbacks=dashboards``) and a WGAN-GP run (``callbacks=gan_dashboards``) in one
log folder, served by a real TensorBoard. Its data API and the event files say what each run has;
where Debian's ``chromium`` is installed a headless browser renders every tab and the test reads
them. With ``GRADREG_SCREENSHOTS=<folder>`` the browser also saves each tab there (the
``docs/dashboard*.png`` pictures are made so)."""

from __future__ import annotations

import base64
import json
import os
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator as ea

from tests.app.browser import Chromium, executable
from tests.tensorboard_server import poll

from .helpers import run_script

# the module's runs of the app (a sweep and a GAN run), shared by its tests (~16 s)
pytestmark = pytest.mark.slow
# the runs are named after their zero-padded job number, penalty and weight: which run had
# which penalty, in job order
SWEEP = ["000_none", "001_double_backprop:0.1"]
# the sweep's own run: its summary (text), metric-vs-λ figure and the HParams declaration
SUMMARY = "summary"
GAN_OVERRIDES = ["experiment=gan_8gaussians_wgan_gp", "data.n_train=5120", "data.n_val=256",
                 "data.n_test=256", "trainer.max_epochs=1"]
CLASSIFIER_METRICS = ["val/acc", "val/acc_pgd", "test/acc", "test/acc_fgsm", "test/acc_pgd",
                      "test/input_grad_norm"]
# the 8 Gaussians have no sample scorer: no test/kl, test/feature_energy_distance
GAN_METRICS = ["val/energy_distance", "test/energy_distance", "test/wasserstein", "test/modes",
               "test/high_quality"]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 20-batch WGAN-GP run on 8 Gaussians, then ``-m penalty=none,double_backprop
    callbacks=dashboards`` (20 steps per run), in one folder: the sweep's end declares the
    folder's HParams table from all three runs."""
    root = tmp_path_factory.mktemp("logs")
    gan = run_script(*GAN_OVERRIDES, "trainer.enable_progress_bar=false", f"paths.runs={root}")
    assert gan.returncode == 0, gan.stderr[-3000:]
    sweep = run_script("-m", "penalty=none,double_backprop", "callbacks=dashboards",
                       "trainer.max_epochs=1", "+trainer.limit_train_batches=20",
                       "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1",
                       "trainer.log_every_n_steps=2", "callbacks.saliency.every_n_steps=10",
                       "callbacks.grad_split.every_n_steps=5", "model.pgd_steps=2",
                       "trainer.enable_progress_bar=false", f"hydra.sweep.dir={root}")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    return root


def run_names(root: Path) -> list[str]:
    """The TensorBoard run names of the trained runs: the folders holding event files, relative
    to the log folder, but the sweep's summary run."""
    return sorted({path.parent.relative_to(root).as_posix()
                   for path in root.rglob("events.out.tfevents.*")} - {SUMMARY})


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


def loaded_session_groups(url: str, body: dict, timeout: float = 60.0) -> dict:
    """The HParams plugin's session groups once every session's end is loaded: TensorBoard lists
    a run before it has read its event file to the end, where the session's end (its status)
    is, so a loaded machine can ask in between and see ``STATUS_UNKNOWN``."""
    deadline = time.monotonic() + timeout
    while True:
        groups = hparams_request(url, "session_groups", body)
        sessions = [session for group in groups["sessionGroups"] for session in group["sessions"]]
        if sessions and all(session["status"] != "STATUS_UNKNOWN" for session in sessions):
            return groups
        if time.monotonic() > deadline:
            return groups  # the test's assertions say what is missing
        time.sleep(0.5)


def test_the_runs_are_named_after_their_penalty_and_weight(logs: Path) -> None:
    names = run_names(logs)
    assert names[:2] == SWEEP
    (gan,) = names[2:]
    assert re.fullmatch(r"wgan_gp:0\.1_\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d_data\.n_test:256"
                        r"\+data\.n_train:5120\+data\.n_val:256"
                        r"\+experiment:gan_8gaussians_wgan_gp\+trainer\.max_epochs:1",
                        gan), gan
    # what tells the runs apart is within TensorBoard's ~40 characters of a run list
    assert all(":0.1" in name[:40] or name == "000_none" for name in names)
    # nothing at the log folder's root: no run "."
    assert not list(logs.glob("events.out.tfevents.*"))


def test_the_event_files_hold_one_tag_per_quantity_for_both_kinds(logs: Path) -> None:
    none, double_backprop, gan = (event_file(logs, run) for run in run_names(logs))
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
    # one tag per quantity: the total and the weighted penalties only under the monitor's tags
    assert not {"train/total", "train/penalty/double_backprop"} & set(classifier_tags["scalars"])
    assert not {"train/critic/wgan_gp"} & set(gan_tags["scalars"])
    assert {"train/critic/adversarial", "train/generator/adversarial"} <= set(gan_tags["scalars"])
    # the gradient split, every 5 steps: per layer; the penalty-free run has no penalty part,
    # share or cosine (undefined, not 0), only the task's
    layers = ["backbone.fc1", "backbone.fc2", "backbone.out"]
    assert {f"grad_split/{quantity}/{layer}" for quantity in ("task", "penalty", "penalty_share",
                                                              "cosine") for layer in layers} <= (
        set(classifier_tags["scalars"]))
    shares = double_backprop.Scalars("grad_split/penalty_share/backbone.fc1")
    assert [e.step for e in shares] == [4, 9, 14, 19]
    assert all(0 < e.value < 1 for e in shares)
    none_split = {tag for tag in none.Tags()["scalars"] if tag.startswith("grad_split/")}
    assert none_split == {f"grad_split/task/{layer}" for layer in layers}
    # the penalty-free run's baseline: the double-backprop penalty it would have had, weight 0,
    # under the penalized run's tag
    baseline = none.Scalars("penalty/unweighted/penalties.double_backprop")
    assert [e.step for e in baseline] == [e.step for e in weights] and all(
        e.value > 0 for e in baseline)
    assert {e.value for e in none.Scalars("penalty/weight/penalties.double_backprop")} == {0.0}
    assert "grad_split/penalty/critic.fc1" in gan_tags["scalars"]
    # the generator's loss has no penalty: its task part only, no all-zero penalty series
    assert not [tag for tag in gan_tags["scalars"] if tag.startswith("grad_split/")
                and "generator" in tag and not tag.startswith("grad_split/task/")]
    assert set(classifier_tags["histograms"]) == {"input_grad/norm"} | {
        f"{group}/backbone.{layer}" for group in ("param_grad", "param_grad_bias")
        for layer in ("fc1", "fc2", "out")}
    assert {"interpolates/grad_norm", "param_grad/critic.fc1",
            "param_grad/generator.fc1"} <= set(gan_tags["histograms"])
    assert [e.value for e in gan.Scalars("interpolates/grad_norm_target")] == [1.0, 1.0]
    assert set(classifier_tags["images"]) == {"saliency", "graph/autograd"}
    # the critic's and the generator's graphs, each once (the generator's first step is batch 5)
    assert set(gan_tags["images"]) == {"critic_landscape/score", "critic_landscape/grad_norm",
                                       "graph/autograd/critic", "graph/autograd/generator"}
    assert [image.step for image in gan.Images("graph/autograd/critic")] == [0]
    assert [image.step for image in gan.Images("graph/autograd/generator")] == [4]
    # the critic landscape's interval (200 steps) is longer than the run: its last image
    assert [image.step for image in gan.Images("critic_landscape/grad_norm")] == [19]


def test_the_sweep_writes_its_summary(logs: Path) -> None:
    """The baseline once at λ = 0, the penalized run at its λ with its difference from it (one
    seed: no interval); the figure in the folder and in the summary run."""
    summary = (logs / "summary.md").read_text()
    section = summary.split("## test/acc_pgd (max)\n\n")[1].split("\n\n")[1]
    rows = [line.split(" | ")[:3] for line in section.splitlines()[2:]]
    assert rows == [["| none", "0", "1/1"], ["| double_backprop", "0.1", "1/1"]]
    assert (logs / "metric_vs_weight.png").is_file()
    run = event_file(logs, SUMMARY)
    assert run.Tags()["images"] == ["Sweep/metric_vs_weight", "Sweep/validation_curves"]
    assert (logs / "validation_curves.png").is_file()


def test_tensorboard_serves_every_dashboard_and_one_hparams_table(logs: Path, serve) -> None:
    url = serve(logs)
    names = run_names(logs)
    assert sorted(poll(f"{url}/data/runs", lambda runs: len(runs) == 4)) == sorted(
        [*names, SUMMARY])
    plugins = poll(f"{url}/data/plugins_listing",
                   lambda listing: listing.get("hparams", {}).get("enabled"))
    for plugin in ("scalars", "custom_scalars", "images", "text", "hparams", "histograms"):
        assert plugins[plugin]["enabled"], plugin
    text = poll(f"{url}/data/plugin/text/tags", lambda tags: len(tags) == 4)
    assert all(set(text[run]) == {"autograd_graph/text/text_summary",
                                  "autograd_graph/dot/text_summary"} for run in names)
    assert text[SUMMARY] == ["Sweep/summary/text_summary"]
    experiment = hparams_request(url, "experiment", {"experimentName": ""})
    infos = {info["name"]: info.get("differs", False) for info in experiment["hparamInfos"]}
    # the columns marked (shown first) are those whose values differ between the runs; one
    # weight column, the effective λ
    assert {"penalty", "weight", "lr", "lr_log10", "batch_size"} <= {
        name for name, on in infos.items() if on}
    assert not [name for name in infos if name.startswith("penalty/weight/")]
    assert not {"seed", "max_epochs", "n_critic", "activation"} & {
        name for name, on in infos.items() if on}
    assert "None" not in json.dumps(experiment)
    metrics = [info["name"]["tag"] for info in experiment["metricInfos"]]
    assert metrics == CLASSIFIER_METRICS + GAN_METRICS
    # every run, of either kind, has its lr, batch size and weight in the one table, and ended
    # well, after it started
    groups = loaded_session_groups(url, {
        "experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS",
                                                  "STATUS_FAILURE", "STATUS_RUNNING"],
        "colParams": [{"hparam": name} for name in ("lr", "batch_size", "weight")],
        "startIndex": 0, "sliceSize": 10})
    rows = {group["name"]: group["hparams"] for group in groups["sessionGroups"]}
    assert {name: (row["lr"], row["batch_size"], row["weight"]) for name, row in rows.items()
            } == dict(zip(names, [(0.001, 64, 0.0), (0.001, 64, 0.1), (0.0001, 256, 0.1)],
                          strict=True))
    for group in groups["sessionGroups"]:
        (session,) = group["sessions"]
        assert session["status"] == "STATUS_SUCCESS"
        assert 0 < session["startTimeSecs"] < session["endTimeSecs"]


def drawn_images(browser: Chromium, wanted: set[tuple[str, str]],
                 timeout: float = 30.0) -> dict[tuple[str, str], tuple[int, int]]:
    """(run, tag) -> the natural size of each image of TensorBoard's images plugin that the page
    has loaded (its address names them: ``blob_key``, base64 JSON of [experiment, plugin, run,
    tag, step, index]), once every ``wanted`` one has."""
    deadline = time.monotonic() + timeout
    while True:
        drawn = {}
        for src, width, height in browser.images():
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(src).query)
            if "blob_key" in query and width:
                key = query["blob_key"][0]
                padded = key + "=" * (-len(key) % 4)
                _, _, run, tag, *_ = json.loads(base64.urlsafe_b64decode(padded))
                drawn[run, tag] = (width, height)
        if wanted <= set(drawn) or time.monotonic() > deadline:
            return drawn
        time.sleep(0.5)


# what each tab must show once rendered
TABS = {
    # Time Series opens on the sweep's figures, their cards open (then the first group of the runs'
    # own, here the GAN's critic landscape), not on an epoch chart
    "timeseries": [*SWEEP, "Sweep /metric_vs_weight summary Step 0",
                   "Sweep /validation_curves summary Step 0", "grad_norm 3 cards",
                   "graph 4 cards"],
    # one outcome metric per chart, each saying where its final values are; one chart per
    # layer of the gradient split
    "custom_scalars": [*SWEEP, "outcome: val/acc, clean accuracy", "outcome: val/acc_fgsm",
                       "outcome: val/acc_pgd", "outcome: val/energy_distance",
                       "outcome: val/modes covered",
                       "final values: HParams tab, smoothing and 'ignore outliers' hide them",
                       "task loss (train)", "penalty double_backprop, unweighted P",
                       "penalty wgan_gp, unweighted P", "penalties, weighted",
                       "gradient of layer backbone.fc1", "gradient of layer critic.fc1",
                       "penalty weights λ", "loss + penalty (train)",
                       "penalty/weight/penalties.wgan_gp (wgan_gp:0.1_",
                       "critic gradient norm ‖∇D(x̂)‖ at interpolates"],
    "hparams": ["TABLE VIEW", *SWEEP, "batch_size", "lr", "lr_log10", "weight",
                "penalty", "none", "double_backprop", "wgan_gp", "val/acc",
                "val/energy_distance", "Number of matching session groups: 3"],
    # the sweep's figures first, open; then the runs' groups
    "images": [*SWEEP, SUMMARY, "Sweep 2 Sweep/metric_vs_weight summary",
               "Sweep/validation_curves summary", "critic_landscape/grad_norm", "graph 4",
               "saliency"],
    "images&tagFilter=Sweep/": [SUMMARY, "Sweep/metric_vs_weight", "Sweep/validation_curves"],
    # one card per layer: 3 for each classifier, 4 for each of the GAN's networks
    "histograms": [*SWEEP, "param_grad 14", "interpolates/grad_norm", "input_grad/norm"],
    "histograms&tagFilter=param_grad/": ["param_grad/backbone.fc1", "param_grad/critic.fc1"],
    # Time Series with its filter set in the address: the penalty's share of each layer's gradient
    "?tagFilter=penalty_share#timeseries": [*SWEEP, "grad_split/penalty_share /backbone.fc1",
                                            "Tags matching filter"],
    "text": [*SWEEP, "autograd_graph/text/text_summary", "NllLossBackward0",
             "Sweep/summary/text_summary", "Δ vs baseline (95% CI)"],
}
# the tabs whose screenshots are the documentation's pictures (those of the Images tab are of a
# larger sweep: scripts/dashboard_screenshots.py)
SCREENSHOTS = {"custom_scalars": "dashboard.png", "hparams": "dashboard_hparams.png",
               "histograms&tagFilter=param_grad/": "dashboard_histograms.png",
               "?tagFilter=penalty_share#timeseries": "dashboard_grad_split.png"}


@pytest.mark.skipif(executable() is None,
                    reason="needs a browser: Debian's chromium (apt-get install chromium)")
def test_the_tabs_render_in_a_browser(logs: Path, serve, tmp_path: Path) -> None:
    url = serve(logs)
    shots = Path(os.environ.get("GRADREG_SCREENSHOTS", tmp_path))
    browser = Chromium(tmp_path / "profile", width=1600, height=1200)
    try:
        for tab, needles in TABS.items():
            browser.open(f"{url}/{tab}" if tab.startswith("?") else f"{url}/#{tab}")
            text = browser.wait_for_text(*needles)
            if tab == "timeseries":
                assert "epoch" not in text.split()
                # where TensorBoard opens: the sweep's two figures (the first's title: the
                # chosen λ) are the first group below the pinned cards
                assert text.split("Pin cards for a quick view and comparison")[1].split()[:5] == [
                    "Sweep", "2", "cards", "Sweep", "/metric_vs_weight"]
            if tab == "hparams":
                # no column blank for some run (weight_log10 of penalty=none: the parallel
                # coordinates would leave the run out), none equal in every run (seed)
                assert not {"weight_log10", "seed", "n_critic"} & set(text.split())
                browser.click_checkbox("weight")
            if tab == "images&tagFilter=Sweep/":
                # the sweep's two figures, drawn whole: each card's image as large as its file
                figures = {(SUMMARY, f"Sweep/{name}"): Image.open(logs / f"{name}.png").size
                           for name in ("metric_vs_weight", "validation_curves")}
                drawn = drawn_images(browser, set(figures))
                assert {key: drawn.get(key) for key in figures} == figures
            if tab in SCREENSHOTS:
                time.sleep(2)  # the charts' drawing animations
                browser.screenshot(shots / SCREENSHOTS[tab])
    finally:
        browser.close()
