"""Fixtures shared by the test packages."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.tensorboard_server import start_tensorboard, stop


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
