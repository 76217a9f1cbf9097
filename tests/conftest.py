"""Tests marked ``cuda`` need a CUDA device: skipped without one (CI has none), run on a GPU
machine with ``python -m pytest -m cuda``."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `python -m pytest -m cuda` on one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
