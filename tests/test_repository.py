"""What the repository tracks: source and text, no large files, no binaries but the
documentation's screenshots (a wheel, a checkpoint or a data file belongs in a package index, a
release or the run's output folder, which .gitignore keeps out)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the largest file the repository tracks
MAX_BYTES = 1_000_000
#: the binary files it tracks, as (folder, extension): the screenshots and plots of docs/ (PNG
#: images, which the test opens as such)
ALLOWED_BINARIES = frozenset({("docs", ".png")})
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: extensions of binary files (any other file is binary if its first 8 KiB hold a NUL byte)
BINARY_EXTENSIONS = frozenset({
    ".whl", ".egg", ".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".7z", ".so", ".dll", ".dylib",
    ".exe", ".o", ".a", ".pyc", ".pt", ".pth", ".ckpt", ".safetensors", ".bin", ".onnx", ".npy",
    ".npz", ".pkl", ".pickle", ".h5", ".hdf5", ".parquet", ".db", ".sqlite", ".png", ".jpg",
    ".jpeg", ".gif", ".bmp", ".webp", ".ico", ".pdf", ".mp4", ".webm",
})


def tracked_files() -> list[str]:
    """The paths git tracks that exist in the working tree (relative, ``/``-separated)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
    return [path for path in listing.split("\0") if path and (ROOT / path).is_file()]


def is_binary(path: Path) -> bool:
    if path.suffix.lower() in BINARY_EXTENSIONS:
        return True
    with path.open("rb") as file:
        return b"\0" in file.read(8192)


def test_no_tracked_file_is_over_1_mb():
    large = [f"{path} ({(ROOT / path).stat().st_size:,} bytes)" for path in tracked_files()
             if (ROOT / path).stat().st_size > MAX_BYTES]
    assert not large, f"tracked files over {MAX_BYTES:,} bytes: {large}"


def allowed(path: str) -> bool:
    """A binary the repository may track: a PNG image directly in docs/."""
    where = PurePosixPath(path)
    if (str(where.parent), where.suffix.lower()) not in ALLOWED_BINARIES:
        return False
    with (ROOT / path).open("rb") as file:
        return file.read(len(PNG_SIGNATURE)) == PNG_SIGNATURE


def test_no_tracked_binary_but_the_docs_screenshots():
    refused = sorted(path for path in tracked_files()
                     if is_binary(ROOT / path) and not allowed(path))
    assert not refused, (
        f"tracked binary files: {refused}; the repository tracks no binary but the PNG "
        "screenshots and plots of docs/ (ALLOWED_BINARIES)")


def test_the_checks_see_a_binary(tmp_path: Path):
    """The detection itself: by extension, by a NUL byte, and not on text."""
    (tmp_path / "wheel.whl").write_text("not really a wheel")
    (tmp_path / "data").write_bytes(b"header\0payload")
    (tmp_path / "notes.md").write_text("# text only, ünïcode too\n")
    assert is_binary(tmp_path / "wheel.whl") and is_binary(tmp_path / "data")
    assert not is_binary(tmp_path / "notes.md")


def test_only_png_images_in_docs_are_allowed():
    assert allowed("docs/dashboard.png")
    assert not allowed("docs/sub/dashboard.png") and not allowed("dashboard.png")
    assert not allowed("docs/index.md")


#: control characters a text file may hold: none but the newline (a tab, a backspace or a form
#: feed in a source is a docstring's ``\t``, ``\b`` or ``\f`` written outside a raw string:
#: ``\theta`` rendered as a tab and "heta")
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")


def test_no_control_character_in_a_python_or_markdown_file():
    found = [f"{path}:{number}" for path in tracked_files()
             if path.endswith((".py", ".md", ".yaml", ".toml"))
             for number, line in enumerate((ROOT / path).read_text(encoding="utf-8")
                                           .split("\n"), 1)
             if CONTROL.search(line)]
    assert not found, f"control characters (outside raw strings?) at {found}"


#: an escape that turns a docstring's LaTeX into a control character: ``\theta`` (tab),
#: ``\bar`` (backspace), ``\frac`` (form feed), ``\rangle`` (carriage return), ``\nabla``
#: (newline), ``\alpha`` (bell), ``\varepsilon`` (vertical tab)
ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\[abfnrtv][A-Za-z]")


def test_docstrings_with_backslashes_are_raw_strings():
    found = []
    for path in tracked_files():
        if not path.endswith(".py"):
            continue
        source = (ROOT / path).read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                              | ast.AsyncFunctionDef) or not node.body:
                continue
            first = node.body[0]
            if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                continue
            text = ast.get_source_segment(source, first.value) or ""
            if not text[:2].lower().startswith("r") and ESCAPE.search(text):
                found.append(f"{path}:{first.lineno}")
    assert not found, f"docstrings whose LaTeX escapes become control characters: {found}"
