"""Tiny models here: one intra-op thread is faster than two (no fork/join per op) and does not
fight the rest of the suite for the machine's cores."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
