"""Hydra's private names that the app uses, pinned: a Hydra release that moves one fails here,
naming it and gradreg/app/hydra_compat.py, the one module to change."""

from __future__ import annotations

import importlib

import hydra
import pytest

from gradreg.app import hydra_compat

PRIVATE_NAMES = [("hydra._internal.utils", "get_args_parser"),
                 ("hydra._internal.utils", "run_and_report")]


@pytest.mark.parametrize(("module", "name"), PRIVATE_NAMES)
def test_the_private_names_still_exist(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), (
        f"Hydra {hydra.__version__} has no {module}.{name}: update "
        "gradreg/app/hydra_compat.py")


def test_the_command_line_parser_separates_overrides_from_hydra_flags() -> None:
    parser = hydra_compat.command_line_parser()
    args, unknown = parser.parse_known_args(
        ["-m", "penalty=none,double_backprop", "seed=range(3)", "--cfg", "job"])
    assert (args.overrides, args.multirun, args.cfg, unknown) == (
        ["penalty=none,double_backprop", "seed=range(3)"], True, "job", []), (
        f"Hydra {hydra.__version__} parses its command line differently: update "
        "gradreg/app/hydra_compat.py")


def test_hydra_reports_through_the_wrapped_function(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``reporting_errors``, an error Hydra reports reaches the app's function first;
    where that returns, Hydra's own report follows (status 1), and the wrapper is gone after."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    compat = hydra_compat
    utils = importlib.import_module("hydra._internal.utils")
    original, seen = utils.run_and_report, []

    def fail() -> None:
        raise ZeroDivisionError("from inside Hydra")

    with compat.reporting_errors(seen.append), pytest.raises(SystemExit) as exit_info:
        utils.run_and_report(fail)
    assert [type(error) for error in seen] == [ZeroDivisionError], (
        f"Hydra {hydra.__version__} reports its errors elsewhere: update "
        "gradreg/app/hydra_compat.py")
    assert exit_info.value.code == 1 and "from inside Hydra" in capsys.readouterr().err
    assert utils.run_and_report is original
