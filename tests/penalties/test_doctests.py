"""The examples in the docstrings of ``gradreg.penalties`` run as written (``doctest``), and
every public class and function of the package has one."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

import gradreg.penalties

MODULES = ["gradreg.penalties"] + [
    info.name for info in pkgutil.walk_packages(gradreg.penalties.__path__, "gradreg.penalties.")]
PUBLIC = [name for name in gradreg.penalties.__all__
          if inspect.isclass(getattr(gradreg.penalties, name))
          or inspect.isfunction(getattr(gradreg.penalties, name))]


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_of_a_module_run_as_written(name: str) -> None:
    module = importlib.import_module(name)
    results = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples failed in {name}"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_class_and_function_has_an_example(name: str) -> None:
    doc = inspect.getdoc(getattr(gradreg.penalties, name)) or ""
    assert "Examples:" in doc and ">>>" in doc, f"gradreg.penalties.{name} has no Examples: (>>>)"


def test_the_package_docstring_is_an_example() -> None:
    assert ">>>" in (gradreg.penalties.__doc__ or "")
    assert len(PUBLIC) >= 25  # the presets, the mechanism, the points, the random state
