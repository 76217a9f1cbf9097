"""docs/app.md's table of configuration groups lists every option of configs/, and nothing else:
a YAML file added to a group folder fails this test until the table names it."""

from __future__ import annotations

import re

from .conftest import CONFIGS, ROOT

DOC = ROOT / "docs" / "app.md"


def table_options() -> dict[str, set[str]]:
    """group -> the options the table's row names (the backticked words of its options cell)."""
    section = DOC.read_text().split("## Configuration groups", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return {row[0].strip("| `"): set(re.findall(r"`([^`]+)`", row[1])) for row in rows}


def config_options() -> dict[str, set[str]]:
    """group (``hydra/sweeper``) -> the options its folder of configs/ holds."""
    groups: dict[str, set[str]] = {}
    for path in CONFIGS.rglob("*.yaml"):
        if path.parent != CONFIGS:
            groups.setdefault(path.parent.relative_to(CONFIGS).as_posix(), set()).add(path.stem)
    return groups


def test_the_groups_table_lists_every_option_of_the_configs_folder() -> None:
    documented, present = table_options(), config_options()
    assert sorted(documented) == sorted(present)
    for group, options in present.items():
        assert documented[group] == options, (
            f"docs/app.md's row of {group}: missing {sorted(options - documented[group])}, "
            f"not in configs/{group}/: {sorted(documented[group] - options)}")
