"""The package as people install it: ``pip install gradreg`` is the core with torch alone, the
layers above it come with extras, and a missing extra is one line naming it.

Each check runs in a fresh Python (a subprocess): what a module imports shows only in a process
that has not imported it yet. ``sys.modules[name] = None`` stands for a package that is not
installed (``import name`` then raises ``ModuleNotFoundError``, ``find_spec`` finds nothing).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradreg

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]

#: the packages of the extras, which the core must not import
OPTIONAL = ("lightning", "pytorch_lightning", "hydra", "omegaconf", "sklearn", "matplotlib",
            "tensorboard", "torchvision")
#: the modules of the core, all of them torch only
CORE = ("gradreg", "gradreg.penalties", "gradreg.models", "gradreg.evaluation.metrics",
        "gradreg.evaluation.sample_quality", "gradreg.sharding", "gradreg.attention")


def python(code: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python, from the checkout, with ``blocked`` not importable."""
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    return subprocess.run([sys.executable, "-c", f"import sys\n{block}{code}"], cwd=ROOT,
                          text=True, capture_output=True, timeout=120)


def test_core_imports_no_optional_package():
    result = python(f"import {', '.join(CORE)}\n"
                    f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(OPTIONAL)}))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_core_computes_a_penalty_without_the_extras():
    """With every optional package made unimportable, R1 of the critic D(x) = x·w is
    γ/2 · ‖w‖² = 10/2 · (1 + 4 + 4) = 45 for every sample (∇ₓD = w), and the parameter gradient
    of the mean penalty is γ · w = (10, 20, -20)."""
    code = """
import torch
import gradreg, gradreg.penalties
w = torch.tensor([1.0, 2.0, -2.0], dtype=torch.float64, requires_grad=True)
x = gradreg.penalties.as_points(torch.randn(4, 3, dtype=torch.float64))
penalty = gradreg.penalties.r1(10.0)(x @ w, x)
penalty.backward()
print(penalty.item(), w.grad.tolist())
"""
    result = python(code, blocked=OPTIONAL)
    assert result.returncode == 0, result.stderr
    value, grad = result.stdout.split(" ", 1)
    assert float(value) == 45.0
    assert grad.strip() == "[10.0, 20.0, -20.0]"


def test_the_core_without_numpy_imports_without_torchs_numpy_warning():
    """torch without numpy (the core needs none) warns "Failed to initialize NumPy" while it
    imports itself (torch 2.13.0+cpu: torch.export's FunctionalTensor); imported by gradreg, it
    does not, and the core runs."""
    result = python(f"import {', '.join(CORE)}\nimport torch\n"
                    "x = torch.tensor([3.0], requires_grad=True)\n"
                    "print(gradreg.gradient((x ** 2).sum(), x).item())", blocked=("numpy",))
    assert result.returncode == 0 and result.stdout == "6.0\n", result.stderr
    assert "Failed to initialize NumPy" not in result.stderr, result.stderr


@pytest.mark.parametrize(("module", "missing", "message"), [
    ("gradreg.lightning.classifier", "lightning", "gradreg.lightning needs lightning"),
    ("gradreg.lightning.dashboards", "tensorboard", "gradreg.lightning needs tensorboard"),
    ("gradreg.lightning.callbacks", "matplotlib", "gradreg.lightning needs matplotlib"),
    ("gradreg.lightning", "numpy", "gradreg.lightning needs numpy"),
    ("gradreg.lightning.data", "sklearn", "gradreg.lightning.data needs scikit-learn"),
    ("gradreg.lightning.data.toy", "lightning", "gradreg.lightning needs lightning"),
])
def test_a_missing_extra_is_one_line_naming_it(module: str, missing: str, message: str):
    result = python(f"import {module}", blocked=(missing,))
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        f"ImportError: {message}, which is not installed: pip install 'gradreg[lightning]' "
        "(in a checkout: pip install -e '.[lightning]')")


def test_the_readme_shows_the_error_of_a_missing_extra_as_python_prints_it():
    """``python -c "import gradreg.lightning"`` without Lightning: a traceback of two frames
    (the import, the package raising the error; none of a helper's) and the one line the README
    shows."""
    result = subprocess.run(
        [sys.executable, "-c", "import sys\nsys.modules['lightning'] = None\n"
                               "import gradreg.lightning"],
        cwd=ROOT, text=True, capture_output=True, timeout=120)
    lines = result.stderr.splitlines()
    assert result.returncode == 1
    assert len(lines) == 5, result.stderr
    assert lines[0] == "Traceback (most recent call last):"
    assert re.fullmatch(r'  File ".*gradreg.lightning.__init__\.py", line \d+, in <module>',
                        lines[2]), lines[2]
    assert lines[3] == "    raise ImportError(missing)"
    assert f"```text\n{lines[4]}\n```" in (ROOT / "README.md").read_text()


def test_several_missing_packages_are_named_together():
    result = python("import gradreg.lightning", blocked=("lightning", "tensorboard"))
    assert result.stderr.splitlines()[-1] == (
        "ImportError: gradreg.lightning needs lightning, tensorboard, which are not installed: "
        "pip install 'gradreg[lightning]' (in a checkout: pip install -e '.[lightning]')")


def test_the_app_without_its_extra_is_one_line_and_status_2():
    result = python("import runpy\nsys.argv = ['scripts/train.py']\n"
                    "runpy.run_path('scripts/train.py', run_name='__main__')", blocked=("hydra",))
    assert result.returncode == 2
    assert result.stderr == (
        "error: python scripts/train.py needs hydra-core, which is not installed: "
        "pip install 'gradreg[app]' (in a checkout: pip install -e '.[app]')\n")


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of the modules ``path`` imports, other than gradreg's, the standard
    library's and ``importlib.import_module`` calls with a literal name."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"gradreg", "__future__"}


def requirement_name(requirement: str) -> str:
    """``"scikit-learn>=1.3"`` -> ``"scikit-learn"``."""
    for i, char in enumerate(requirement):
        if not (char.isalnum() or char in "-_."):
            return requirement[:i]
    return requirement


def names(requirements: list[str]) -> set[str]:
    return {requirement_name(requirement) for requirement in requirements}


#: import name -> distribution name (PIL: Pillow, which torchvision installs; omegaconf and yaml
#: come with hydra-core)
DISTRIBUTION = {"sklearn": "scikit-learn", "PIL": "torchvision", "hydra": "hydra-core",
                "omegaconf": "hydra-core", "yaml": "hydra-core", "mlflow": "mlflow-skinny"}
#: the extras of each package of gradreg ("": the top-level modules)
LAYERS = {"": (), "attention": (), "penalties": (), "models": (), "evaluation": (),
          "integrations": (), "lightning": ("lightning",), "app": ("app", "lightning")}
#: modules that import an optional package at their top, imported by their path only (their
#: package does not re-export them), with their extra: add a new one here
IMPORTED_BY_PATH = {"models/resnet.py": ("vision",), "models/torchvision_import.py": ("vision",),
                    "lightning/data/image_folder.py": ("vision",),
                    # deepspeed: imported only where a model runs under DeepSpeed
                    "integrations/hf_trainer.py": ("transformers", "deepspeed"),
                    "integrations/engine_penalty.py": ("deepspeed",),
                    "integrations/zero_sharded.py": ("deepspeed",),
                    "app/sweeps/search.py": ("sweeps",), "app/sweeps/pruning.py": ("sweeps",),
                    "app/trackers.py": ("trackers",), "attention/triton.py": ("triton",)}


def extra_packages(extras: tuple[str, ...]) -> set[str]:
    return set().union(*(names(PROJECT["optional-dependencies"][extra]) for extra in extras))


@pytest.mark.parametrize("package", LAYERS)
def test_what_each_layer_imports_is_installed_by_its_extras(package: str):
    """Every third-party module a layer's source imports is torch or in one of its extras; the
    core's (torch alone) but in the modules imported by path."""
    root = ROOT / "gradreg"
    files = sorted(root.glob("*.py")) if not package else sorted((root / package).rglob("*.py"))
    for path in files:
        by_path = IMPORTED_BY_PATH.get(path.relative_to(root).as_posix(), ())
        allowed = {"torch"} | extra_packages(LAYERS[package] + by_path)
        imported = {DISTRIBUTION.get(name, name) for name in third_party_imports(path)}
        assert imported <= allowed, f"{path.relative_to(ROOT)} imports {imported - allowed}"


def test_every_package_of_gradreg_is_a_layer_here():
    root = ROOT / "gradreg"
    packages = {path.parent.relative_to(root).parts[0]
                for path in root.rglob("__init__.py") if path.parent != root}
    assert packages == set(LAYERS) - {""}


def test_the_core_depends_on_torch_alone_and_the_extras_build_on_each_other():
    extras = PROJECT["optional-dependencies"]
    assert names(PROJECT["dependencies"]) == {"torch"}
    assert names(extras["lightning"]) == {"lightning", "tensorboard", "scikit-learn",
                                          "matplotlib", "numpy", "threadpoolctl"}
    assert names(extras["app"]) == {"gradreg", "hydra-core", "scipy"}
    assert "gradreg[lightning]" in extras["app"]
    assert "gradreg[app]" in extras["dev"] and "gradreg[app]" in extras["sweeps"]


def test_license_version_and_citation_agree():
    assert PROJECT["license"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    citation = (ROOT / "CITATION.cff").read_text()
    assert f'\nversion: "{PROJECT["version"]}"\n' in citation
    assert "\nlicense: MIT\n" in citation
    assert gradreg.__version__ == PROJECT["version"]
    assert f"## [{PROJECT['version']}]" in (ROOT / "CHANGELOG.md").read_text()


def test_the_wheel_lists_every_package_and_every_config_group():
    """pyproject.toml lists the packages (setuptools does not find gradreg/app/configs, which is
    configs/ in a checkout): each folder of gradreg/ with an __init__.py, and configs/ with each
    of its folders as gradreg.app.configs.<group>."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    code = {".".join(path.parent.relative_to(ROOT).parts)
            for path in (ROOT / "gradreg").rglob("__init__.py")}
    configs = {".".join(("gradreg", "app", *path.relative_to(ROOT).parts))
               for path in (ROOT / "configs").rglob("*") if path.is_dir()}
    plugins = {".".join(path.parent.relative_to(ROOT).parts)
               for path in (ROOT / "hydra_plugins").rglob("__init__.py")}
    assert listed == code | {"gradreg.app.configs"} | configs | plugins
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"gradreg.app.configs": "configs"}
    assert PROJECT["scripts"] == {"gradreg-train": "gradreg.app:main"}


def test_help_says_what_the_app_does_and_lists_the_groups_without_lightning():
    """``gradreg-train --help``: the description, the usage, every config group with its options
    (the yaml files of configs/<group>/), answered without importing Lightning."""
    result = python("sys.argv = ['gradreg-train', '--help']\n"
                    "from gradreg.app import main\n"
                    "try:\n    main()\nexcept SystemExit:\n    pass\n"
                    "print('lightning imported:', 'lightning' in sys.modules)")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith("gradreg-train: train a model with gradient penalties")
    assert "Usage: gradreg-train [group=option ...] [key=value ...]" in text
    for group in sorted(path for path in (ROOT / "configs").iterdir()
                        if path.is_dir() and path.name != "hydra"):
        options = ", ".join(sorted(option.stem for option in group.glob("*.yaml")))
        assert f"\n{group.name}: {options}\n" in text
    assert text.rstrip().endswith("lightning imported: False")


#: the pair of the install page's commands for the vision extra, from PyTorch's CPU index too
PAIR = re.compile(r"^pip install torch==(\S+) torchvision==(\S+)( --index-url (\S+))?",
                  re.MULTILINE)


def test_the_install_page_installs_a_matching_vision_pair_and_says_how_to_get_cpu_builds():
    """docs/install.md's torchvision commands install one pair, of a torch in the project's range,
    once from PyPI and once from PyTorch's CPU wheel index (adding the extra alone to a CPU
    torch of another release replaces it with PyPI's CUDA build)."""
    commands = PAIR.findall((ROOT / "docs" / "install.md").read_text())
    assert {(torch, vision) for torch, vision, _, _ in commands} == {("2.14.1", "0.29.1")}
    assert [index for *_, index in commands] == ["", "https://download.pytorch.org/whl/cpu"]
    (torch_requirement,) = PROJECT["dependencies"]
    assert torch_requirement == "torch>=2.4,<2.15"  # 2.14.1 is the newest release it admits
    assert "torchvision>=0.19" in PROJECT["optional-dependencies"]["vision"]

