"""The folders of ``gradreg.penalties`` are its floors, and imports point down only.

Presets (``presets``, the package's ``__init__``) -> the mechanism (``mechanism``, ``config``,
``two_pass``, ``accumulation``, a step's ``terms``; when a penalty runs, ``lazy``, and where,
``points``) -> how a penalty is computed (``methods/``) and what it penalizes (``kinds/``) -> one
call of a penalty as they see it (``call``) -> the formulas (``formulas/``) -> the checks
(``guards/``) -> the state a call carries (``state/``). Every import of one module of the package
by another is read from the source (``ast``, the imports under ``TYPE_CHECKING`` included): none
points to a higher floor, the modules form no cycle, and each sub-package's docstring names its
floor.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import gradreg.penalties

ROOT = Path(gradreg.penalties.__file__).parent
PACKAGE = "gradreg.penalties"
#: Each top-level module or sub-package of gradreg.penalties and its floor (higher imports lower).
LAYERS = {
    "__init__": 6, "presets": 6,
    "mechanism": 5, "config": 5, "two_pass": 5, "accumulation": 5, "lazy": 5, "points": 5,
    "terms": 5, "shards": 5,
    "methods": 4, "kinds": 4,
    "call": 3,
    "formulas": 2,
    "guards": 1,
    "state": 0,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def unit(module: str) -> str:
    """The top-level module or sub-package of the package that ``module`` belongs to."""
    rest = module[len(PACKAGE) + 1:] if module != PACKAGE else "__init__"
    return rest.split(".")[0]


def imports(*, typing: bool = True) -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports (``typing``: also
    those imported under ``if TYPE_CHECKING:``, for annotations only)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        tree = ast.parse(path.read_text())
        skipped = set() if typing else {
            id(node) for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            for node in ast.walk(block)}
        found = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == PACKAGE:  # from gradreg.penalties import <module or name>
                    modules = {a.name for a in node.names if (ROOT / a.name).is_dir()
                               or (ROOT / f"{a.name}.py").exists()}
                    found |= {f"{PACKAGE}.{m}" for m in modules}
                    if len(modules) < len(node.names):
                        found.add(PACKAGE)
                elif node.module.startswith(PACKAGE + "."):
                    found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith(PACKAGE + ".")}
        graph[name] = found - {name}
    return graph


def test_every_module_belongs_to_a_layer() -> None:
    assert {unit(name) for name in imports()} == set(LAYERS)


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{name} -> {target}" for name, targets in graph.items()
                  for target in targets if LAYERS[unit(target)] > LAYERS[unit(name)])


def test_imports_point_down_only_annotations_included() -> None:
    """The methods and kinds read a configuration through the protocol of ``call``
    (``Configuration``), not the class above them."""
    assert upward(imports(typing=False)) == upward(imports()) == []


def test_no_import_cycle_between_modules_or_sub_packages() -> None:
    graph = imports()
    tuple(TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    units = {unit(name): set() for name in graph}
    for name, targets in graph.items():
        units[unit(name)] |= {unit(t) for t in targets} - {unit(name)}
    try:
        tuple(TopologicalSorter(units).static_order())
    except CycleError as err:  # pragma: no cover - the message names the cycle
        raise AssertionError(f"sub-packages import each other: {err.args[1]}") from err


def test_the_methods_and_the_kinds_do_not_import_each_other() -> None:
    """Both stand on the protocol of one call (``call``), not on each other."""
    graph = imports()
    crossing = sorted(f"{name} -> {t}" for name, targets in graph.items() for t in targets
                      if {unit(name), unit(t)} == {"methods", "kinds"})
    assert crossing == []


def test_each_sub_package_names_its_floor() -> None:
    """The floor a sub-package's docstring states is the one these tests hold it to."""
    for name, floor in LAYERS.items():
        if (ROOT / name).is_dir():
            doc = (ROOT / name / "__init__.py").read_text()
            assert f"Floor {floor} of ``gradreg.penalties``" in doc, name
