"""The numbers the documentation quotes are those ``scripts/measure_app.py`` measured: each
measured block of its pages (docs/install.md: the test tiers; docs/app.md: the runs and sweeps;
docs/benchmarks.md: the digits GAN's seeds) is the rendering of docs/measured/app.json, and the
recorded runs, sweeps and test tiers are those of the script, with the same arguments, on one
torch release. What can be checked without running them is checked against the checkout as it
is: the tiers' test counts against what pytest collects now. The README, a front page, quotes
no measured number."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("measure_app", ROOT / "scripts" / "measure_app.py")
measure_app = importlib.util.module_from_spec(spec)
spec.loader.exec_module(measure_app)
RECORD = json.loads(measure_app.RECORD.read_text())


def test_every_run_of_the_script_is_recorded_with_its_overrides() -> None:
    assert {name: run["overrides"] for name, run in RECORD["runs"].items()} == measure_app.RUNS
    assert {name: sweep["overrides"] for name, sweep in RECORD["sweeps"].items()} == \
        measure_app.SWEEPS
    assert {name: tier["arguments"] for name, tier in RECORD["tests"].items()} == \
        measure_app.TESTS
    measured = [*RECORD["runs"].values(), *RECORD["sweeps"].values(),
                *RECORD["tests"].values()]
    assert {run["torch"] for run in measured} == {RECORD["machine"]["torch"]}


@pytest.mark.parametrize("page", measure_app.PAGES, ids=lambda page: page.name)
def test_the_measured_blocks_are_the_recorded_numbers(page: Path) -> None:
    text = page.read_text()
    assert measure_app.blocks(text), f"{page.name} has no measured block"
    assert measure_app.blocks(text) == measure_app.blocks(measure_app.render(text, RECORD)), (
        f"{page.name} differs from docs/measured/app.json: python scripts/measure_app.py "
        "--render")


@pytest.mark.slow
def test_the_documented_test_counts_are_those_pytest_collects_now() -> None:
    """The tiers' counts of docs/install.md are the recorded collection's, to two significant
    digits; within 10% of what pytest collects now (tests are added every day; the page said
    1143 where 1499 were collected). Compared where the optional packages of the tests'
    ``importorskip`` calls are those of the recorded collection (CI's torch 2.13 suite: the
    sweeps, trackers and triton extras), since a module skipped at import is not collected."""
    packages = measure_app.optional_test_packages()
    for tier in measure_app.TESTS:
        recorded_with = RECORD["tests"][tier]["collected"]["packages"]
        if packages != recorded_with:
            pytest.skip(f"counts collected with {recorded_with}; this environment has "
                        f"{packages}")
        recorded = RECORD["tests"][tier]["collected"]["count"]
        now = measure_app.collect_tests(tier)["count"]
        assert abs(recorded - now) <= 0.1 * now, (
            f"the {tier} tier: {recorded} tests recorded, {now} collected now: python "
            "scripts/measure_app.py --count-tests (or --only fast slow to time them too)")


def test_a_count_is_given_to_two_significant_digits() -> None:
    assert [measure_app.about(n) for n in (1499, 184, 1143, 96, 7)] == [
        "about 1,500", "about 180", "about 1,100", "about 96", "about 7"]


def test_the_script_renders_the_pages_that_hold_the_tables() -> None:
    assert [page.relative_to(ROOT).as_posix() for page in measure_app.PAGES] == [
        "docs/install.md", "docs/app.md", "docs/benchmarks.md"]
    assert not measure_app.blocks((ROOT / "README.md").read_text())


def test_every_table_is_shown_once() -> None:
    shown = [name for page in measure_app.PAGES for name in measure_app.blocks(page.read_text())]
    assert sorted(shown) == sorted(measure_app.TABLES)


def test_a_block_is_replaced_whole() -> None:
    text = "a\n<!-- measured:default_run -->\nold\nlines\n<!-- /measured:default_run -->\nb\n"
    record = {"runs": {}, "machine": {}}
    tables = dict(measure_app.TABLES)
    try:
        measure_app.TABLES["default_run"] = lambda record: "new"
        assert measure_app.render(text, record) == (
            "a\n<!-- measured:default_run -->\nnew\n<!-- /measured:default_run -->\nb\n")
    finally:
        measure_app.TABLES.clear()
        measure_app.TABLES.update(tables)
