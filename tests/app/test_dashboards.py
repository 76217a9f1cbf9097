"""``callbacks=dashboards`` as a person sees it: a two-run sweep of the real entry point (no penalty
vs double backprop), served by a real TensorBoard; its data API says which plugins have data, and
where Debian's ``chromium`` is installed a headless browser renders the scalars, custom-scalars,
HParams, images and text tabs and the test reads them."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.app.browser import Chromium, executable
from tests.tensorboard_server import poll

from .helpers import run_script

# the runs are named after the swept key: which run had which penalty is in its name
RUNS = ["0_penalty:none/tensorboard", "1_penalty:double_backprop/tensorboard"]
# what each tab must show once rendered: the runs, the penalty charts, the hparams table ...
TABS = {
    # the Time Series tab opens the first tag group; the others are listed by name and size
    "scalars": [*RUNS, "tag: grad_2.0_norm/backbone.fc1.weight", "input_grad 2", "penalty",
                "test 5", "train 3", "val 5"],
    "custom_scalars": [*RUNS, "task loss", "penalties", "input gradient norm",
                       "penalty/penalties.double_backprop (1_penalty:double_backprop/tensorboard)"],
    "hparams": ["TABLE VIEW", *RUNS, "penalty", "none", "double_backprop", "hp/test/acc_pgd",
                "Number of matching session groups: 2"],
    "images": [*RUNS, "saliency"],
    "text": [*RUNS, "autograd_graph/text/text_summary", "NllLossBackward0"],
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``-m penalty=none,double_backprop callbacks=dashboards``, 10 steps per run."""
    root = tmp_path_factory.mktemp("multirun")
    result = run_script("-m", "penalty=none,double_backprop", "callbacks=dashboards",
                        "trainer.max_epochs=1", "+trainer.limit_train_batches=10",
                        "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1",
                        "trainer.log_every_n_steps=2", "callbacks.saliency.every_n_steps=5",
                        "model.pgd_steps=2", "trainer.enable_progress_bar=false",
                        f"hydra.sweep.dir={root}")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def hparams_experiment(url: str) -> dict:
    """The HParams plugin's experiment (its table's columns), as the page asks for it (POST)."""
    request = urllib.request.Request(f"{url}/data/plugin/hparams/experiment",
                                     data=json.dumps({"experimentName": ""}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.load(response)


def test_tensorboard_has_every_dashboard_of_the_sweep(sweep: Path, serve) -> None:
    url = serve(sweep)
    assert poll(f"{url}/data/runs", lambda runs: len(runs) == 2) == RUNS
    plugins = poll(f"{url}/data/plugins_listing",
                   lambda listing: listing.get("hparams", {}).get("enabled"))
    for plugin in ("scalars", "custom_scalars", "images", "text", "hparams", "histograms"):
        assert plugins[plugin]["enabled"], plugin
    text = poll(f"{url}/data/plugin/text/tags", lambda tags: len(tags) == 2)
    assert all(set(text[run]) == {"autograd_graph/text/text_summary",
                                  "autograd_graph/dot/text_summary"} for run in RUNS)
    images = poll(f"{url}/data/plugin/images/tags", lambda tags: len(tags) == 2)
    assert all(set(images[run]) == {"saliency"} for run in RUNS)
    experiment = hparams_experiment(url)
    names = {info["name"] for info in experiment["hparamInfos"]}
    assert {"penalty", "weight", "lr", "hidden", "activation", "batch_size", "max_epochs",
            "seed", "fgsm_eps", "pgd_steps"} <= names
    metrics = {info["name"]["tag"] for info in experiment["metricInfos"]}
    assert metrics == {f"hp/{name}" for name in ("val/acc", "test/acc", "test/acc_fgsm",
                                                 "test/acc_pgd", "test/input_grad_norm")}


@pytest.mark.skipif(executable() is None,
                    reason="needs a browser: Debian's chromium (apt-get install chromium)")
def test_the_tabs_render_in_a_browser(sweep: Path, serve, tmp_path: Path) -> None:
    url = serve(sweep)
    browser = Chromium(tmp_path / "profile")
    try:
        for tab, needles in TABS.items():
            browser.open(f"{url}/#{tab}")
            browser.wait_for_text(*needles)
    finally:
        browser.close()
