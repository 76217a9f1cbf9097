"""Every python block of the README and of docs/ runs as written, from an empty working
directory, alone: a reader copies one example, so a block that uses a name only an earlier block
defines fails here. Each block of the README runs in a fresh interpreter, and what it prints is
what its comments say: a ``print(...)`` line ends with a comment that starts with the printed
line (then ``: `` and an explanation, if any). Each block of a page of docs/ runs in a fresh
namespace (one interpreter per page, a fresh working directory per block)."""

from __future__ import annotations

import json
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


#: pages whose blocks train models (minutes on a CPU)
TRAINING_PAGES = {"callbacks.md"}
#: runs each (name, code) pair read as JSON from stdin in a fresh namespace and a fresh working
#: directory, its output discarded; prints each failing block's name and traceback
RUN_ALONE = """\
import contextlib, io, json, os, sys, tempfile, traceback
failed = False
for name, code in json.load(sys.stdin):
    os.chdir(tempfile.mkdtemp(dir=sys.argv[1]))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed = True
        print(f"--- {name}", traceback.format_exc(), sep="\\n", file=sys.stderr)
sys.exit(failed)
"""


def python_blocks(page: Path) -> list[str]:
    """The ```python fenced blocks of a Markdown page, in order."""
    return PYTHON_BLOCK.findall(page.read_text(encoding="utf-8"))


def located_blocks(text: str, name: str) -> list[tuple[str, str]]:
    """The ```python fenced blocks of the Markdown ``text`` of page ``name``, each with
    ``name:line`` of its opening fence."""
    return [(f"{name}:{text.count(chr(10), 0, match.start()) + 1}", match[1])
            for match in PYTHON_BLOCK.finditer(text)]


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


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def run_python(script: str, folder: Path) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter in ``folder``, with the checkout's gradreg."""
    (folder / "blocks.py").write_text(script, encoding="utf-8")
    return subprocess.run([sys.executable, "blocks.py"], cwd=folder, env=ENV,
                          capture_output=True, text=True, timeout=600)


def run_alone(blocks: list[tuple[str, str]], folder: Path) -> subprocess.CompletedProcess:
    """Each of the (name, code) ``blocks`` in a fresh namespace and working directory under
    ``folder``, one interpreter for all, with the checkout's gradreg."""
    return subprocess.run([sys.executable, "-c", RUN_ALONE, str(folder)], input=json.dumps(blocks),
                          cwd=folder, env=ENV, capture_output=True, text=True, timeout=900)


DOCS_WITH_CODE = [pytest.param(page, id=page.name,
                               marks=[pytest.mark.slow] if page.name in TRAINING_PAGES else [])
                  for page in DOCS if python_blocks(page)]
README_BLOCKS = python_blocks(README)


def test_the_pages_with_code_are_found() -> None:
    names = {param.id for param in DOCS_WITH_CODE}
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


def test_a_block_is_located_by_its_opening_fence() -> None:
    text = "# t\n\n```python\nx = 1\n```\ntext\n```python\ny = 2\n```\n"
    assert located_blocks(text, "p.md") == [("p.md:3", "x = 1\n"), ("p.md:7", "y = 2\n")]


def test_a_block_using_an_earlier_blocks_name_fails_alone(tmp_path: Path) -> None:
    result = run_alone([("p.md:1", "import math\nx = math.pi"), ("p.md:5", "print(x)"),
                        ("p.md:9", "import math\nassert math.pi > 3")], tmp_path)
    assert result.returncode == 1
    assert "--- p.md:5" in result.stderr and "NameError" in result.stderr
    assert "p.md:1" not in result.stderr and "p.md:9" not in result.stderr


@pytest.mark.parametrize("page", DOCS_WITH_CODE)
def test_each_python_block_runs_alone(page: Path, tmp_path: Path) -> None:
    result = run_alone(located_blocks(page.read_text(encoding="utf-8"), page.name), tmp_path)
    assert result.returncode == 0, result.stderr[-6000:]
