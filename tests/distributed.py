"""Start distributed jobs from the tests: processes that meet on a free loopback port, their
errors in the failure message, and one retry for the only failure that is the machine's and not
the code's, a port that another process took between its choice and the job's bind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PORT_TAKEN = "Address already in use"
ATTEMPTS = 2
ERROR_TAIL = 4000  # characters of each failed process's stderr in the failure message


def free_port() -> int:
    """A loopback port that was free when asked (the OS may hand it out again later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_processes(argv: Sequence[str], process_envs: Sequence[dict[str, str]], *,
                  timeout: float = 300, cwd: Path | None = None) -> None:
    """Run ``argv`` once per entry of ``process_envs`` (added to this environment, with
    ``MASTER_ADDR``/``MASTER_PORT`` set to a free port and one intra-op thread), all at once, and
    wait for all of them.

    Raises ``AssertionError`` with the stderr of every process that failed or did not end in
    ``timeout`` seconds (those are killed). A port taken by another process before the job bound
    it is retried once on a fresh port; any other failure is raised at once."""
    for attempt in range(1, ATTEMPTS + 1):
        port = free_port()
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        errors = _run_together(argv, [{**env, **extra} for extra in process_envs], timeout, cwd)
        if not errors:
            return
        if attempt == ATTEMPTS or not any(PORT_TAKEN in error for error in errors):
            raise AssertionError(f"{' '.join(argv)} failed (port {port}, attempt {attempt}):\n"
                                 + "\n---\n".join(error[-ERROR_TAIL:] for error in errors))


def _run_together(argv: Sequence[str], envs: list[dict[str, str]], timeout: float,
                  cwd: Path | None) -> list[str]:
    """The stderr of each process that failed or was still running when another failed or the
    time was up (then it is killed: a rank whose peer died waits in a collective for good).
    Stderr goes to files, so a chatty process never blocks on a full pipe."""
    with tempfile.TemporaryDirectory() as logs:
        paths = [Path(logs) / f"{index}.err" for index in range(len(envs))]
        processes = []
        for env, path in zip(envs, paths, strict=True):
            with path.open("w") as stderr:
                processes.append(subprocess.Popen(list(argv), env=env, cwd=cwd,
                                                  stdout=subprocess.DEVNULL, stderr=stderr))
        deadline = time.monotonic() + timeout
        try:
            while (any(p.poll() is None for p in processes) and time.monotonic() < deadline
                   and not any(p.returncode for p in processes)):
                time.sleep(0.1)
        finally:
            running = [p for p in processes if p.poll() is None]
            for process in running:
                process.kill()
                process.wait()
        return [f"process {index}: "
                + ("killed, still running" if process in running else f"exit {process.returncode}")
                + f"; stderr:\n{path.read_text()}"
                for index, (process, path) in enumerate(zip(processes, paths, strict=True))
                if process in running or process.returncode != 0]


def run_ranks(module: str, out: Path, *args: str, timeout: float = 300,
              **env: str) -> list[dict]:
    """Run ``python -m module out *args`` from the repository root as the 2 ranks of one job
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` set, ``env`` added:
    :func:`run_processes`) and load what each rank saved as ``out/rank{r}.pt``."""
    run_processes([sys.executable, "-m", module, str(out), *args],
                  [{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                    "LOCAL_WORLD_SIZE": "2", **env} for rank in (0, 1)],
                  cwd=ROOT, timeout=timeout)
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def end_rank() -> None:
    """End a rank's process here, its output flushed and its results saved before, skipping the
    interpreter's teardown: with gloo's threads up it hung now and then on torch 2.4."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
