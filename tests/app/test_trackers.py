"""The experiment trackers (``logger=mlflow``, ``logger=wandb``, ``logger=csv``) as users run them,
without a network, read back from what the real packages wrote: MLflow's SQLite store and
artifact folder, W&B's offline run files, the CSV logger's files. Each run is a few batches on
one thread; a tracker whose package is not installed (the trackers extra) is skipped."""

from __future__ import annotations

import html
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import SCRIPT
from .helpers import TINY
from .test_sweeps import trials

TRIAL = [*TINY, "threads=1", "model.pgd_steps=2"]
# the dashboards with the saliency figure at steps 1 and 2 (and at the end: step 3)
FIGURES = ["callbacks=dashboards", "callbacks.saliency.every_n_steps=2"]


def run_in(folder: Path, *args: str, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess:
    """``python scripts/train.py *args`` from ``folder`` (where MLflow's default store goes)."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("HYDRA_FULL_ERROR", "MLFLOW_TRACKING_URI")} | (env or {})
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=folder, env=environment,
                          text=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=300)


def test_logger_csv_keeps_the_config_metrics_and_figures_in_the_run_folder(
        tmp_path: Path) -> None:
    """metrics.csv's test row equals metrics.json; hparams.yaml has the run's config
    (penalty.weight 0.1, model.optimizer.lr 0.001); the saliency figures as PNG files."""
    result = run_in(tmp_path, "logger=csv", *FIGURES, *TRIAL, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    lines = (run / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    (test_row,) = [dict(zip(header, line.split(","), strict=True)) for line in lines[1:]
                   if line.split(",")[header.index("test/acc")]]
    assert float(test_row["test/acc_pgd"]) == pytest.approx(metrics["test/acc_pgd"], abs=1e-7)
    params = yaml.safe_load((run / "hparams.yaml").read_text())
    assert (params["penalty.weight"], params["model.optimizer.lr"], params["seed"]) == (
        0.1, 0.001, 0)
    assert sorted(path.name for path in (run / "figures" / "saliency").iterdir()) == [
        "step_000001.png", "step_000002.png"]


def test_an_unreachable_tracking_server_is_refused_before_training(tmp_path: Path) -> None:
    """Nothing listens on port 9: one line naming the key and the fixes, status 2, no run
    folder, no local store."""
    pytest.importorskip("mlflow")
    result = run_in(tmp_path, "logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:9",
                    *TRIAL)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "error: logger: mlflow.tracking_uri: cannot reach http://127.0.0.1:9: ")
    assert "mlflow server --port 5000" in result.stderr and result.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_wandb_server_is_refused_before_training(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    result = run_in(tmp_path, "logger=wandb", "logger.wandb.offline=false", *TRIAL,
                    env={"WANDB_BASE_URL": "http://127.0.0.1:9"})
    assert result.returncode == 2
    assert result.stderr.startswith(
        "error: logger: wandb.offline=false: cannot reach http://127.0.0.1:9: ")
    assert result.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_logger_mlflow_keeps_each_jobs_config_metrics_figures_and_the_sweeps_summary(
        tmp_path: Path) -> None:
    """``-m 'logger=[mlflow,tensorboard]' penalty=none,double_backprop``: the local store
    (mlflow.db in the working folder) has the sweep's experiment with a run per job, named after
    its folder, whose parameters are the job's config, whose metrics are its metrics.json and
    whose artifacts are its saliency figures; and a run ``summary`` holding summary.md and the
    two figures (the validation curves from the TensorBoard logs)."""
    mlflow = pytest.importorskip("mlflow")
    sweep = tmp_path / "multirun" / "sweep"
    result = run_in(tmp_path, "-m", "logger=[mlflow,tensorboard]", "penalty=none,double_backprop",
                    *FIGURES, *TRIAL, f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stderr[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("gradreg multirun/sweep")
    runs = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
    jobs = trials(sweep)
    assert sorted(runs) == sorted([*(folder.name for folder in jobs), "summary"])
    for folder, (overrides, metrics) in jobs.items():
        run = runs[folder.name]
        assert run.info.status == "FINISHED"
        assert run.data.params["penalty.name"] == overrides["penalty"]
        assert run.data.params["model.optimizer.lr"] == "0.001"
        for name in ("test/acc", "test/acc_pgd", "val/acc_pgd"):
            assert run.data.metrics[name] == pytest.approx(metrics[name], abs=1e-7)
        assert [item.path for item in client.list_artifacts(run.info.run_id,
                                                            "figures/saliency")] == [
            "figures/saliency/step_000001.png", "figures/saliency/step_000002.png"]
    summary = runs["summary"]
    assert sorted(item.path for item in client.list_artifacts(summary.info.run_id)) == [
        "metric_vs_weight.png", "summary.md", "validation_curves.png"]
    copied = client.download_artifacts(summary.info.run_id, "summary.md", str(tmp_path))
    assert Path(copied).read_text() == (sweep / "summary.md").read_text()


def wandb_records(run_folder: Path) -> list:
    """The records of a W&B offline run (its ``run-<id>.wandb`` file: W&B's header, then
    LevelDB's log format of 32 KiB blocks whose records are W&B's protobuf ``Record``)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_folder.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, position, records, pending = 32768, 7, [], b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a record header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            records.append(wandb_internal_pb2.Record.FromString(pending + chunk))
            pending = b""
        elif kind in (2, 3):  # its first or a middle part
            pending += chunk
    return records


def wandb_run(run_folder: Path) -> tuple[str, str, dict, dict]:
    """A W&B offline run read back: its name, group, config and the last value of each logged
    key (JSON-decoded)."""
    records = wandb_records(run_folder)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for r in records
              if r.WhichOneof("record_type") == "config" for item in r.config.update}
    history = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
               for r in records if r.WhichOneof("record_type") == "history"
               for item in r.history.item}
    return run.display_name, run.run_group, config, history


@pytest.mark.slow
def test_logger_wandb_writes_offline_runs_with_config_metrics_figures_and_the_summary(
        tmp_path: Path) -> None:
    """``-m logger=wandb penalty=none,double_backprop``: each job an offline W&B run in its
    folder, named after it, in the sweep's group, with the job's config, its metrics.json's
    values and the saliency figure (a PNG in the run's media); a run ``summary`` in the sweep
    folder with the summary text and the figure."""
    pytest.importorskip("wandb")
    sweep = tmp_path / "multirun" / "sweep"
    result = run_in(tmp_path, "-m", "logger=wandb", "penalty=none,double_backprop", *FIGURES,
                    *TRIAL, f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stderr[-3000:]
    for folder, (overrides, metrics) in trials(sweep).items():
        name, group, config, history = wandb_run(folder)
        assert (name, group) == (folder.name, "gradreg multirun/sweep")
        assert (config["penalty.name"], config["model.optimizer.lr"]) == (
            overrides["penalty"], 0.001)
        for metric in ("test/acc", "test/acc_pgd", "val/acc_pgd"):
            assert history[metric] == pytest.approx(metrics[metric], abs=1e-7)
        (image,) = history["saliency/filenames"]
        assert (next(folder.glob("wandb/offline-run-*")) / "files" / image).is_file()
    name, group, _, history = wandb_run(sweep)
    assert (name, group) == ("summary", "gradreg multirun/sweep")
    files = next(sweep.glob("wandb/offline-run-*")) / "files"
    assert history["sweep/summary/_type"] == "html-file"
    page = html.unescape((files / history["sweep/summary/path"]).read_text())
    assert f"<pre>{(sweep / 'summary.md').read_text()}</pre>" in page
    assert history["sweep/metric_vs_weight/_type"] == "image-file"
    assert (files / history["sweep/metric_vs_weight/path"]).read_bytes() == (
        sweep / "metric_vs_weight.png").read_bytes()
