"""The benchmark's real entry point in --quick mode: it runs and writes valid JSON (no timings
are asserted)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: a line of Kineto's log ("USDT:2026-11-29 04:16:00 ...", "STAGE:...") or of c10's ("[W1129 ...")
NATIVE_LOG_LINE = re.compile(r"^(?:[A-Z]+:\d{4}-\d\d-\d\d |\[[WIE]\d{4} )", re.MULTILINE)


def test_quick_benchmark_writes_json_and_plot(tmp_path: Path) -> None:
    """Also: no line of torch's native logs (68 of its 116 lines were: Kineto's
    "profiler_start" and "profiler_stop" per memory measurement, c10's warning of a block
    allocated before the profile)."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--quick",
                          "--out", str(tmp_path)], check=True, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert not NATIVE_LOG_LINE.findall(run.stdout + run.stderr), run.stderr[-2000:]
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert {"cpu", "torch", "threads"} <= set(report["machine"])
    rows = report["rows"]
    assert {r["case"] for r in rows} == {"mlp/double_backprop", "cnn/double_backprop",
                                         "critic/wgan_gp", "critic/r1"}
    methods = {"plain", "hand", "exact", "lazy16", "subsample", "chunks", "finite_difference"}
    for case in {r["case"] for r in rows}:  # the perturbation estimate: squared, target 0
        expected = methods | ({"perturbation"} if case != "critic/wgan_gp" else set())
        assert {r["method"] for r in rows if r["case"] == case} == expected

    def same(row: dict, method: str) -> dict:  # the row of ``method`` in ``row``'s case
        return next(r for r in rows if r["method"] == method
                    and all(r[k] == row[k] for k in ("case", "batch", "width")))

    for row in rows:
        assert row["median_ms"] > 0
        assert row["ratio"] > 0
        assert row["flops"] > 0
        if row["method"] == "plain":
            assert row["ratio"] == 1.0
            assert row["memory_ratio"] == 1.0
            assert row["flop_ratio"] == 1.0
        if row["method"] == "exact":  # no more products than hand-written (no points' gradient)
            hand = same(row, "hand")
            assert 1.5 < row["flop_ratio"] <= hand["flop_ratio"]
        if row["method"] == "lazy16":  # one step in 16 is an exact one
            exact = same(row, "exact")
            assert row["flop_ratio"] == pytest.approx(1 + (exact["flop_ratio"] - 1) / 16)
    fd_errors = [r["error"] for r in rows if r["method"] == "finite_difference"]
    assert all(0 <= e < 1e-2 for e in fd_errors)  # smooth (tanh) models, float32
    assert all(r["error"] < 1e-5 for r in rows if r["method"] == "chunks")  # exact: rounding
    assert (tmp_path / "benchmark.png").read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "benchmark.md").read_text().splitlines()
    assert table[0].startswith("| case |") and len(table) == 2 + len(rows)


def test_cases_option_runs_only_the_named_kinds(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--quick",
                    "--cases", "critic_r1", "--reps", "1", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, capture_output=True, timeout=300)
    rows = json.loads((tmp_path / "benchmark.json").read_text())["rows"]
    assert {r["case"] for r in rows} == {"critic/r1"}


def test_gpu_suite_runs_small_on_cpu_with_autocast(tmp_path: Path) -> None:
    """The GPU cases, shrunk (--quick: the small BatchNorm ResNet stands in for ResNet-18, which
    needs torchvision), under bf16 autocast; the BatchNorm case also has gradreg's BatchNorm."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--suite", "gpu",
                    "--quick", "--reps", "1", "--autocast", "bf16", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, capture_output=True, timeout=300)
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert report["autocast"] == "bf16" and report["suite"] == "gpu"
    assert {"gpu", "torch"} <= set(report["machine"])
    rows = report["rows"]
    assert {r["case"] for r in rows} == {"bn_cnn/double_backprop", "dcgan/wgan_gp", "dcgan/r1",
                                         "mlp/double_backprop"}
    bn_rows = {r["method"]: r for r in rows if r["case"] == "bn_cnn/double_backprop"}
    assert {"plain", "plain_bn", "hand", "exact", "exact_bn", "lazy16", "chunks"} <= set(bn_rows)
    assert bn_rows["exact_bn"]["error"] < 1e-5  # exact: float32 rounding
    assert bn_rows["exact_bn"]["flops"] == bn_rows["exact"]["flops"]
    assert not any(r["method"].endswith("_bn") for r in rows
                   if r["case"] != bn_rows["plain"]["case"])
    for row in rows:
        if "refused" not in row:
            assert row["median_ms"] > 0 and row["ratio"] > 0
            assert row["method"] == "lazy16" or row["peak_mb"] > 0
    assert all("LeakyRelu" in r["refused"] for r in rows
               if r["case"].startswith("dcgan") and r["method"] == "finite_difference")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                    reason="torchvision is installed")
def test_resnet18_without_torchvision_says_so(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--suite",
                          "gpu", "--cases", "resnet18", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "needs torchvision" in run.stderr


def test_quick_transformer_benchmark_writes_its_rows(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--transformer",
                    "--quick", "--out", str(tmp_path)], check=True, cwd=ROOT,
                   capture_output=True, timeout=300)
    rows = json.loads((tmp_path / "transformer.json").read_text())["rows"]
    assert [(r["case"], r["method"]) for r in rows] == [
        ("vit_critic/r1", m) for m in ("plain", "exact", "math", "approx_r1")] + [
        ("transformer_classifier/param_grad_norm", m)
        for m in ("plain", "gnp_exact", "gnp_math", "gnp_fd")]
    for row in rows:
        assert row["ms"] > 0 and row["memory_mb"] > 0
        if row["method"] == "plain":
            assert row["ratio"] == row["memory_ratio"] == 1.0
    assert "| vit_critic/r1 | exact |" in (tmp_path / "transformer.md").read_text()
