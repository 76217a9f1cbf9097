"""The launcher of the distributed tests: a failure carries every failed process's stderr, a
peer left waiting is killed, and only a taken port is retried."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.distributed import run_processes

# Process 0 fails at once; process 1 would wait a minute for it (as a rank in a collective does).
FAIL_OR_WAIT = ("import os, sys, time\n"
                "if os.environ['INDEX'] == '0': sys.exit('rank 0 broke')\n"
                "time.sleep(60)\n")
# Fails with a taken port the first time, then succeeds (the marker file says it ran before).
PORT_TAKEN_ONCE = ("import pathlib, sys\n"
                   "marker = pathlib.Path(sys.argv[1])\n"
                   "if not marker.exists():\n"
                   "    marker.touch(); sys.exit('RuntimeError: Address already in use')\n")


def test_a_failure_names_each_process_and_kills_the_peer_left_waiting() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_processes([sys.executable, "-c", FAIL_OR_WAIT], [{"INDEX": "0"}, {"INDEX": "1"}])
    assert time.monotonic() - start < 30
    message = str(failure.value)
    assert "attempt 1" in message
    assert "process 0: exit 1; stderr:\nrank 0 broke" in message
    assert "process 1: killed, still running" in message


def test_a_taken_port_is_retried_once(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    run_processes([sys.executable, "-c", PORT_TAKEN_ONCE, str(marker)], [{}])
    assert marker.exists()


def test_a_port_taken_twice_fails_with_the_error() -> None:
    always = "import sys; sys.exit('RuntimeError: Address already in use')"
    with pytest.raises(AssertionError, match="(?s)attempt 2.*Address already in use"):
        run_processes([sys.executable, "-c", always], [{}])
