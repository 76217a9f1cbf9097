"""A real ``tensorboard --logdir`` serves what the callbacks wrote, through its HTTP data API."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gradreg.lightning.callbacks import CustomScalarsLayout, GradientNormMonitor
from tests.lightning.test_callbacks import PlainClassifier, fit

READY_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Path], str]]:
    """Start TensorBoard on a log directory; return its base URL. Stopped at the end, always."""
    servers: list[subprocess.Popen] = []

    def start(logdir: Path) -> str:
        port = free_port()
        command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                   "--host", "127.0.0.1", "--port", str(port), "--load_fast=false",
                   "--reload_interval", "1"]
        log = tmp_path / "tensorboard.log"
        with log.open("w") as output:
            server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        servers.append(server)
        url = f"http://127.0.0.1:{port}"
        poll(f"{url}/data/runs", lambda answer: True, server, log)
        return url

    yield start
    for server in servers:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def poll(url: str, ready: Callable[[Any], bool], server: subprocess.Popen | None = None,
         log: Path | None = None) -> Any:
    """GET ``url`` until ``ready(answer)`` or the timeout; the server loads in the background."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"TensorBoard exited with {server.returncode}: {log.read_text()}")
        try:
            answer = get(url)
            if ready(answer):
                return answer
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            answer = None
        if time.monotonic() > deadline:
            raise TimeoutError(f"TensorBoard did not serve {url} in {READY_TIMEOUT_S} s: {answer}")
        time.sleep(0.25)


def test_tensorboard_serves_runs_scalars_and_layout(tmp_path: Path, serve) -> None:
    run = fit(tmp_path, PlainClassifier(), [CustomScalarsLayout(), GradientNormMonitor()])
    name = Path(run.logger.log_dir).relative_to(tmp_path).as_posix()  # lightning_logs/version_0
    url = serve(tmp_path)

    assert name in poll(f"{url}/data/runs", lambda runs: name in runs)
    tags = poll(f"{url}/data/plugin/scalars/tags", lambda answer: name in answer)[name]
    assert {"train/loss", "penalty/gp", "grad_2.0_norm_total", "input_grad/norm_mean"} <= set(tags)
    layout = poll(f"{url}/data/plugin/custom_scalars/layout", bool)
    (category,) = layout["category"]
    assert category["title"] == "gradreg"
    charts = {chart["title"]: chart["multiline"]["tag"] for chart in category["chart"]}
    assert charts["penalties"] == [r"(.*/)?penalty/.*"]
    assert len(charts) == 5
