"""Shared by the test packages: the skip of tests marked ``cuda`` without a CUDA device (CI has
none; run them on a GPU machine with ``python -m pytest -m cuda``), Triton's interpreter without
one, and a real TensorBoard."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.tensorboard_server import start_tensorboard, stop

# Without a GPU, Triton's kernels (gradreg.attention.triton) run in its interpreter: Triton reads
# this when a kernel is defined, so it is set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `python -m pytest -m cuda` on one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Path], str]]:
    """Start TensorBoard on a log directory; return its base URL. Stopped at the end, always."""
    servers = []

    def start(logdir: Path) -> str:
        server, url = start_tensorboard(logdir, tmp_path / f"tensorboard{len(servers)}.log")
        servers.append(server)
        return url

    yield start
    for server in servers:
        stop(server)
