"""``scripts/benchmark.py --sharded --quick``: 2 gloo ranks write every setup's memory; the
shards of the parameters and Adam's moments partition the unsharded ones (no timings or peaks
are asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gradreg.sharding import supports_exact_step

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(not supports_exact_step(), reason="fully_shard is public from 2.6")
def test_sharded_memory_benchmark_writes_every_setup_of_both_ranks(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--sharded",
                    "--quick", "--out", str(tmp_path)], check=True, cwd=ROOT,
                   capture_output=True, timeout=300)
    report = json.loads((tmp_path / "sharded.json").read_text())
    rows = report["rows"]
    setups = ("unsharded", "sharded_task", "sharded_exact", "sharded_fd")
    assert sorted((r["setup"], r["rank"]) for r in rows) == sorted(
        (s, rank) for s in setups for rank in (0, 1))
    at_rest = {(r["setup"], r["rank"]): r["at_rest_mb"] for r in rows}
    whole = at_rest["unsharded", 0]
    assert at_rest["unsharded", 1] == whole
    for setup in setups[1:]:
        assert at_rest[setup, 0] + at_rest[setup, 1] == pytest.approx(whole, rel=1e-12)
        assert at_rest[setup, 0] < whole
    assert all(r["step_mb"] > 0 and r["total_mb"] == pytest.approx(r["at_rest_mb"] + r["step_mb"])
               for r in rows)
    assert "| 64 | 12,545 | sharded_exact |" in (tmp_path / "sharded.md").read_text()
