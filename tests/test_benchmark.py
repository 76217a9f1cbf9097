"""The benchmark's real entry point in --quick mode: it runs and writes valid JSON (no timings
are asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_json_and_plot(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--quick",
                    "--out", str(tmp_path)], check=True, cwd=ROOT, capture_output=True,
                   timeout=300)
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert {"cpu", "torch", "threads"} <= set(report["machine"])
    rows = report["rows"]
    assert {r["case"] for r in rows} == {"mlp/double_backprop", "cnn/double_backprop",
                                         "critic/wgan_gp", "critic/r1"}
    methods = {"plain", "hand", "exact", "lazy16", "subsample", "finite_difference"}
    for case in {r["case"] for r in rows}:
        assert {r["method"] for r in rows if r["case"] == case} == methods
    for row in rows:
        assert row["median_ms"] > 0
        assert row["ratio"] > 0
        if row["method"] == "plain":
            assert row["ratio"] == 1.0
            assert row["memory_ratio"] == 1.0
    fd_errors = [r["error"] for r in rows if r["method"] == "finite_difference"]
    assert all(0 <= e < 1e-2 for e in fd_errors)  # smooth (tanh) models, float32
    assert (tmp_path / "benchmark.png").read_bytes()[:4] == b"\x89PNG"
