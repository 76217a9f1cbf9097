"""Every python block of the README and of docs/ runs as written, from an empty working
directory. Each block of the README runs alone in a fresh interpreter (a reader copies one
example), and what it prints is what its comments say: a ``print(...)`` line ends with a comment
that starts with the printed line (then ``: `` and an explanation, if any). The blocks of a page of
docs/ run in order in one fresh interpreter (as a reader pastes them into one session). A block
that needs an object its page (a README block: the block itself) never defines fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
#: a line that prints, and its comment: what it prints (then ": " and an explanation, if any)
PRINT_LINE = re.compile(r"^\s*print\(.*\)\s+# (?P<comment>.*)$")


def python_blocks(page: Path) -> list[str]:
    """The ```python fenced blocks of a Markdown page, in order."""
    return PYTHON_BLOCK.findall(page.read_text(encoding="utf-8"))


def printed_comments(block: str) -> list[str]:
    """The comments of the ``print(...)`` lines of ``block``, in order; AssertionError for a
    print without one (a reader could not tell what it prints)."""
    comments = []
    for line in block.splitlines():
        if line.lstrip().startswith("print("):
            match = PRINT_LINE.match(line)
            assert match, f"a print without what it prints in a comment: {line!r}"
            comments.append(match["comment"])
    return comments


def says(comment: str, printed: str) -> bool:
    """Whether ``comment`` is the ``printed`` line, exactly, then ``: `` and an explanation."""
    return comment == printed or comment.startswith(printed + ": ")


def run_python(script: str, folder: Path) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter in ``folder``, with the checkout's gradreg."""
    (folder / "blocks.py").write_text(script, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "blocks.py"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)


DOCS_WITH_CODE = [page for page in DOCS if python_blocks(page)]
README_BLOCKS = python_blocks(README)


def test_the_pages_with_code_are_found() -> None:
    names = {page.name for page in DOCS_WITH_CODE}
    assert {"core.md", "penalties.md", "callbacks.md"} <= names
    assert len(README_BLOCKS) == 4


def test_the_readme_is_a_front_page_of_at_most_10_kb() -> None:
    """The README is what it is, install, a first example per entry point and links; the
    measured tables, the CI matrix and the install details live in docs/."""
    assert len(README.read_bytes()) <= 10 * 1024


def test_a_printed_line_is_checked_against_its_comment() -> None:
    block = 'x = 1\nprint(x + 1)  # 2: one more\nprint("a#b")    # a#b\n'
    assert printed_comments(block) == ["2: one more", "a#b"]
    assert says("2: one more", "2") and says("a#b", "a#b")
    assert not says("tensor([210.])", "tensor([210.], grad_fn=<MulBackward0>)")
    assert not says("20: twenty", "2")
    with pytest.raises(AssertionError, match="a print without"):
        printed_comments("print(x)\n")


def test_a_block_is_found_whole() -> None:
    page = "text\n```python\nx = 1\n\ny = x + 1\n```\n```bash\nls\n```\n"
    assert PYTHON_BLOCK.findall(page) == ["x = 1\n\ny = x + 1\n"]


@pytest.mark.slow
@pytest.mark.parametrize("block", range(len(README_BLOCKS)), ids=lambda i: f"README-{i + 1}")
def test_each_readme_block_runs_alone_and_prints_what_it_says(block: int,
                                                              tmp_path: Path) -> None:
    code = README_BLOCKS[block]
    expected = printed_comments(code)
    result = run_python(code, tmp_path)
    assert result.returncode == 0, f"README block {block + 1}:\n{result.stderr[-4000:]}"
    printed = result.stdout.splitlines()
    assert len(printed) == len(expected), (printed, expected)
    for comment, line in zip(expected, printed, strict=True):
        assert says(comment, line), f"README block {block + 1} prints {line!r}, says {comment!r}"


@pytest.mark.slow
@pytest.mark.parametrize("page", DOCS_WITH_CODE, ids=lambda page: page.name)
def test_python_blocks_run_as_written(page: Path, tmp_path: Path) -> None:
    script = "\n\n".join(
        f"# --- block {i} of {page.name}\n{block}" for i, block in enumerate(python_blocks(page))
    )
    result = run_python(script, tmp_path)
    assert result.returncode == 0, f"{page.name}:\n{result.stderr[-4000:]}"
