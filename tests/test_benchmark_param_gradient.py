"""scripts/benchmark.py --param-gradient --quick runs and writes its JSON and tables (no timings
are asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_param_gradient_benchmark_writes_json(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--param-gradient",
                    "--quick", "--out", str(tmp_path)], check=True, cwd=ROOT,
                   capture_output=True, timeout=300)
    report = json.loads((tmp_path / "param_gradient.json").read_text())
    assert {"cpu", "torch", "threads"} <= set(report["machine"])
    assert {r["method"] for r in report["rows"]} == {
        "plain", "hand_gnp", "gnp_plain_form", "gnp", "gnp_backward", "hand_sam", "sam",
        "sam_backward"}
    for row in report["rows"]:
        assert row["median_ms"] > 0 and row["peak_mb"] >= 0
        assert (row["vs_hand"] is None) == row["method"].startswith(("plain", "hand"))
    # float32 finite difference against float64 double backward: a relative error per step
    assert all(0 < e["error"] < 1 for e in report["errors"])
    assert "| step r |" in (tmp_path / "param_gradient.md").read_text()
