"""A real ``tensorboard --logdir`` serves what the callbacks wrote, through its HTTP data API."""

from __future__ import annotations

from pathlib import Path

from gradreg.lightning.callbacks import CustomScalarsLayout, GradientNormMonitor
from tests.lightning.helpers import PlainClassifier, fit
from tests.tensorboard_server import poll


def test_tensorboard_serves_runs_scalars_and_layout(tmp_path: Path, serve) -> None:
    run = fit(tmp_path, PlainClassifier(), [CustomScalarsLayout(), GradientNormMonitor()])
    name = Path(run.logger.log_dir).relative_to(tmp_path).as_posix()  # lightning_logs/version_0
    url = serve(tmp_path)

    assert name in poll(f"{url}/data/runs", lambda runs: name in runs)
    tags = poll(f"{url}/data/plugin/scalars/tags", lambda answer: name in answer)[name]
    assert {"train/loss", "penalty/unweighted/gp", "grad_norm/total",
            "input_grad/norm_mean"} <= set(tags)
    layout = poll(f"{url}/data/plugin/custom_scalars/layout", bool)
    (category,) = layout["category"]
    assert category["title"] == "gradreg"
    charts = {chart["title"]: chart["multiline"]["tag"] for chart in category["chart"]}
    assert charts["penalty gp, unweighted P"] == [r"penalty/unweighted/gp$"]
    assert len(charts) == 7
