"""Run folder names: the penalty and its weight first, one folder per run even when two runs
start in the same second with the same overrides (gradreg/app/run_names.py)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gradreg.app import run_names

from .helpers import TINY, run_script


@pytest.mark.parametrize(("name", "weight", "penalties", "label"), [
    ("double_backprop", 0.1, {}, "double_backprop:0.1"),
    ("none", 0.0, {}, "none"),
    ("r1", 10, {"r2": {"weight": 1.0}}, "r1:10+r2:1"),
    ("none", 0.0, {"hidden": {"weight": 0.15676677195506075}}, "hidden:0.1568"),
    ("wgan_gp", None, None, "wgan_gp"),
])
def test_the_label_is_the_penalties_and_their_weights(name: str, weight: object,
                                                      penalties: dict | None, label: str) -> None:
    assert run_names.penalty_label(name, weight, penalties) == label


def test_a_folder_made_first_by_another_run_is_not_shared(tmp_path: Path) -> None:
    base = str(tmp_path / "none_2026-11-24" / "18-00-00")
    assert run_names.claim_folder(base, "_seed:1") == f"{base}_seed:1"
    assert run_names.claim_folder(base, "_seed:1") == f"{base}-2_seed:1"
    assert run_names.claim_folder(base, "_seed:1") == f"{base}-3_seed:1"
    assert run_names.claim_folder(base) == base  # another name: its own first claim
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    # a parent that cannot be made: the name unmade, for the app's own check to name
    assert run_names.claim_folder(str(blocked / "x")) == str(blocked / "x")


def test_a_jobs_folder_names_the_swept_keys_its_label_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_names.os, "environ", {})
    monkeypatch.setattr("sys.argv", ["train.py", "-m", "penalty.weight=0.1,1", "seed=0,1",
                                     "model.optimizer.lr=1e-3,1e+20"])
    overrides = "model.optimizer.lr:1e+20+penalty.weight:0.1+seed:0+trainer.max_epochs:1"
    assert run_names.other_swept(overrides) == "_model.optimizer.lr:1e+20+seed:0"
    assert run_names.other_swept("penalty:none+penalty.weight:0.1") == ""


def test_two_runs_started_together_with_the_same_overrides_get_a_folder_each(
        tmp_path: Path) -> None:
    """Before: runs started in the same second with the same overrides shared one folder (3 of
    3 tries). The default penalty names the folder, double_backprop:0.1."""
    args = [*TINY, "logger=none", "callbacks=none", f"paths.runs={tmp_path}"]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run_script(*args), range(2)))
    assert all(result.returncode == 0 for result in results), results[0].stderr[-2000:]
    folders = sorted(tmp_path.glob("*/*"))
    assert len(folders) == 2
    for folder in folders:
        assert re.fullmatch(r"double_backprop:0\.1_\d{4}-\d\d-\d\d", folder.parent.name)
        assert re.fullmatch(r"\d\d-\d\d-\d\d(-2)?_.*\+callbacks:none\+logger:none\+.*", folder.name)
        assert (folder / "metrics.json").is_file()
    printed = {line.split()[-1] for result in results for line in result.stdout.splitlines()
               if line.startswith("metrics:")}
    assert printed == {str(folder / "metrics.json") for folder in folders}


def test_a_jobs_number_is_zero_padded_so_that_the_jobs_sort_in_order() -> None:
    assert [run_names.job_id(number) for number in (0, 7, "12", 123)] == [
        "000", "007", "012", "123"]
    assert sorted(run_names.job_id(n) for n in (10, 2, 1)) == ["001", "002", "010"]


def test_the_hparams_weight_is_the_one_the_run_uses_and_its_log10_is_blank_at_zero() -> None:
    """penalty=none ignores penalty.weight: its λ is 0, whose log10 is left blank."""
    assert run_names.effective_weight("none", 0.3) == 0.0
    assert run_names.effective_weight("r1", 10) == 10.0
    assert run_names.effective_weight("r1", None) == 0.0
    assert [run_names.log10(value) for value in (0.001, 100, 0.0, None)] == [
        -3.0, 2.0, None, None]


@pytest.mark.parametrize(("value", "short"), [
    ("0.15676677195506075", "0.1568"), ("0.0026938830192854116", "0.002694"),
    ("1.2345678e-05", "1.235e-05"), ("0.1", "0.1"), ("1e-05", "1e-05"), ("10", "10"),
    ("12345678", "12345678"), ("none", "none"), ("[1.23456,2]", "[1.23456,2]"),
    ("nan", "nan")])
def test_folder_names_shorten_long_floats_only(value: str, short: str) -> None:
    assert run_names.short_number(value) == short
