"""Every python block of the README and of docs/ runs as written: the blocks of one file in
order, in one fresh interpreter (as a reader pastes them into one session), from an empty
working directory. A block that needs an object the page never defines fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(page: Path) -> list[str]:
    """The ```python fenced blocks of a Markdown page, in order."""
    return PYTHON_BLOCK.findall(page.read_text(encoding="utf-8"))


PAGES_WITH_CODE = [page for page in PAGES if python_blocks(page)]


def test_the_pages_with_code_are_found() -> None:
    names = {page.name for page in PAGES_WITH_CODE}
    assert {"README.md", "core.md", "penalties.md", "callbacks.md"} <= names


def test_a_block_is_found_whole() -> None:
    page = "text\n```python\nx = 1\n\ny = x + 1\n```\n```bash\nls\n```\n"
    assert PYTHON_BLOCK.findall(page) == ["x = 1\n\ny = x + 1\n"]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda page: page.name)
def test_python_blocks_run_as_written(page: Path, tmp_path: Path) -> None:
    script = "\n\n".join(
        f"# --- block {i} of {page.name}\n{block}" for i, block in enumerate(python_blocks(page))
    )
    (tmp_path / "blocks.py").write_text(script, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    result = subprocess.run(
        [sys.executable, "blocks.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{page.name}:\n{result.stderr[-4000:]}"
