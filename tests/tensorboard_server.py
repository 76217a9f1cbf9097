"""Start a real ``tensorboard --logdir`` and read its HTTP data API (helpers for the tests)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.distributed import free_port

READY_TIMEOUT_S = 60.0


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


def start_tensorboard(logdir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """A TensorBoard serving ``logdir`` on a free loopback port, and its base URL once it
    answers; its output goes to ``log``."""
    port = free_port()
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
               "--host", "127.0.0.1", "--port", str(port), "--load_fast=false",
               "--reload_interval", "1"]
    with log.open("w") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    poll(f"{url}/data/runs", lambda answer: True, server, log)
    return server, url


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
