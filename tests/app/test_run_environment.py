"""What a run prints and how it runs: no progress-bar redraws or advertisements in a log, one
CPU thread by default in every thread pool of the process, float64 training, and a torchvision
that cannot load said in one line (and hidden from the runs that do not use it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradreg.app import runtime
from gradreg.models.torchvision_import import matching_install

from .conftest import QUIET, ROOT
from .helpers import TINY, run_in_process, run_script

ddp_strategy = runtime.ddp_strategy


def test_a_run_logged_to_a_file_has_no_progress_bars_tips_or_internal_warnings(
        tmp_path: Path) -> None:
    """stdout is a pipe here, as in CI or `> train.log`: no bar redraws (before: one line per
    step), no '💡 Tip' advertisement, no deprecation warning from Lightning's internals."""
    args = [arg for arg in TINY if "progress_bar" not in arg]
    result = run_script(*args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "it/s]" not in output and "Epoch 0:" not in output
    assert "💡" not in output and "LeafSpec" not in output
    assert "final metrics:" in result.stdout
    # train.log holds what the console showed (but the model summary's table): Lightning's
    # messages, once each on the console, the callbacks' lines and the app's own
    logged = [line.split("] - ", 1)[1] for line in  # a record's first line (some have more)
              (tmp_path / "train.log").read_text().splitlines() if "] - " in line]
    lightning = [line.removeprefix("INFO: ") for line in output.splitlines()
                 if line.startswith("INFO: ")]
    assert "GPU available: False, used: False" in lightning
    assert sorted(set(lightning)) == sorted(lightning)
    app = result.stdout[result.stdout.index("final metrics:"):].splitlines()
    assert [line for line in logged if line in lightning] == lightning
    assert logged[-len(app):] == app
    assert app[-2:] == [f"metrics:          {tmp_path / 'metrics.json'}",
                        f"open the logs:    tensorboard --logdir {tmp_path}"]


def test_precision_64_trains_in_float64(tmp_path: Path) -> None:
    """Before: 'mat1 and mat2 must have the same dtype' (the model summary's float32 input)."""
    result = run_script(*TINY, "+trainer.precision=64-true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert state["backbone.fc1.weight"].dtype == torch.float64


#: two runs in one fresh Python, each followed by the threads of every pool of the process
THREADS_OF_TWO_RUNS = """
import json, os, runpy, sys
import threadpoolctl, torch
for threads in (1, 2):
    sys.argv = ["scripts/train.py", *{args!r}, f"threads={{threads}}",
                f"hydra.run.dir={folder}/{{threads}}"]
    runpy.run_path("scripts/train.py", run_name="__main__")
    print(json.dumps({{
        "torch": torch.get_num_threads(),
        "pools": {{p["filepath"]: p["num_threads"] for p in threadpoolctl.threadpool_info()}},
        "environment": {{name: os.environ.get(name) for name in {variables!r}}}}}))
"""


def test_threads_sets_every_thread_pool_of_the_run(tmp_path: Path) -> None:
    """``threads=1``: torch, OpenBLAS (numpy's, scipy's) and the OpenMP runtimes (torch's,
    scikit-learn's) each on 1 thread, and the environment that the processes a run starts (DDP
    ranks, sweep jobs) inherit says 1; ``threads=2``: 2 everywhere. Run in a Python started
    without the thread variables (before: OpenBLAS and scikit-learn's OpenMP kept one thread per
    core, 2 here)."""
    env = {key: value for key, value in os.environ.items()
           if key not in (*runtime.THREAD_VARIABLES, "HYDRA_FULL_ERROR")}
    code = THREADS_OF_TWO_RUNS.format(args=[*TINY, "logger=none", "callbacks=none", *QUIET],
                                      folder=tmp_path, variables=runtime.THREAD_VARIABLES)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                            capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 2
    for threads, report in zip((1, 2), reports, strict=True):
        assert report["torch"] == threads
        pools = report["pools"]
        assert any("scikit_learn" in path for path in pools), pools  # its OpenMP was loaded
        assert any("numpy" in path for path in pools), pools
        assert set(pools.values()) == {threads}, pools
        assert report["environment"] == dict.fromkeys(runtime.THREAD_VARIABLES, str(threads))


@pytest.mark.parametrize(("failure", "message"), [
    (RuntimeError("operator torchvision::nms does not exist"),
     "error: model: model=resnet18: torchvision 0.28.0 cannot load with torch "),
    (ModuleNotFoundError("No module named 'torchvision'"),
     "error: model: model=resnet18 needs torchvision (the vision extra), the release built for "
     f"torch {torch.__version__}: {matching_install(torch.__version__)}, then "),
])
def test_a_torchvision_that_cannot_load_is_one_line_naming_the_pair(
    failure: Exception, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU-only torch with the package index's torchvision fails inside torchvision's import
    ('operator torchvision::nms does not exist'): before, a traceback."""
    import importlib

    from gradreg.models import torchvision_import

    real_import = importlib.import_module

    def failing_import(name: str, *args: object) -> object:
        if name == "torchvision":
            raise failure
        return real_import(name, *args)

    monkeypatch.setattr(torchvision_import.importlib, "import_module", failing_import)
    monkeypatch.setattr(torchvision_import.metadata, "version", lambda name: "0.28.0")
    import gradreg.models

    # a fresh import of the model's module (Hydra finds an imported one as the package's
    # attribute): the torchvision that is installed is never reached
    monkeypatch.delitem(sys.modules, "gradreg.models.resnet", raising=False)
    monkeypatch.delattr(gradreg.models, "resnet", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process("model=resnet18", "model.input_shape=[1,16,16]", tmp_path=tmp_path)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err
    if isinstance(failure, RuntimeError):
        assert ("(operator torchvision::nms does not exist); they are not built for each other. "
                f"Install the torchvision built for this torch: "
                f"{matching_install(torch.__version__)}") in err


@pytest.mark.parametrize(("torch_version", "command"), [
    ("2.13.0+cpu", "pip install torch==2.13.0 'torchvision==0.28.*' "
                   "--index-url https://download.pytorch.org/whl/cpu"),
    ("2.14.1", "pip install torch==2.14.1 'torchvision==0.29.*'"),
    ("2.4.1+cu121", "pip install torch==2.4.1 'torchvision==0.19.*' "
                    "--index-url https://download.pytorch.org/whl/cu121"),
    ("2.6.0+rocm6.2.4", "pip install torch==2.6.0 'torchvision==0.21.*' "
                        "--index-url https://download.pytorch.org/whl/rocm6.2.4"),
    ("2.15.0.dev20261101+cpu", "install the torchvision built for torch "
                               "2.15.0.dev20261101+cpu (from the same source)"),
])
def test_the_torchvision_advice_keeps_the_users_torch(torch_version: str, command: str) -> None:
    """Before: torch==2.14.1 torchvision==0.29.1 for every torch, which pip takes from PyPI
    (on Linux the CUDA build) over a CPU torch 2.13. Now the torchvision series of the installed
    release (torch 2.y with torchvision 0.(y + 15), as torch 2.4.1 / 0.19.1 and 2.14.1 / 0.29.1),
    the torch pinned, from PyTorch's index of its build."""
    assert matching_install(torch_version) == command


@pytest.mark.parametrize(("strategy", "manual", "expected"), [
    ("ddp", True, "ddp_find_unused_parameters_true"),
    ("ddp_spawn", True, "ddp_spawn_find_unused_parameters_true"),
    ("ddp", False, "ddp"), ("auto", True, "auto")])
def test_find_unused_parameters_only_for_manual_optimization(strategy: str, manual: bool,
                                                             expected: str) -> None:
    """The GAN's phases leave a network without gradient; the classifier uses every parameter,
    where the search finds nothing and torch warned on every rank."""
    assert ddp_strategy(strategy, manual) == expected


@pytest.mark.parametrize(("strategy", "manual", "start_method"), [
    ("ddp", False, "popen"), ("ddp_spawn", True, "spawn")])
def test_global_batches_get_the_ddp_that_weights_uneven_slices(strategy: str, manual: bool,
                                                                start_method: str) -> None:
    from gradreg.lightning.global_batch import GlobalBatchDDPStrategy

    chosen = ddp_strategy(strategy, manual, global_batch=True)
    assert isinstance(chosen, GlobalBatchDDPStrategy)
    assert chosen._start_method == start_method
    assert chosen._ddp_kwargs.get("find_unused_parameters", False) is manual
    assert ddp_strategy("auto", manual, global_batch=True) == "auto"


# A torchvision that cannot load with the installed torch (``operator torchvision::nms does not
# exist``) stops only the commands that use it, with one line naming the pair; the others train.
# Before, Lightning's import of torchmetrics imported it and every command ended in a traceback.
#
# The torchvision here is a package of the test's own, first on ``PYTHONPATH``, with a
# distribution's metadata (as pip installs it) and an import that raises as the real mismatch does.
MISMATCH = "operator torchvision::nms does not exist"


@pytest.fixture
def unloadable_torchvision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A torchvision 0.29.1 whose import raises RuntimeError, first on the path of subprocesses."""
    site = tmp_path / "site"
    (site / "torchvision").mkdir(parents=True)
    (site / "torchvision" / "__init__.py").write_text(f"raise RuntimeError({MISMATCH!r})\n")
    (site / "torchvision-0.29.1.dist-info").mkdir()
    (site / "torchvision-0.29.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.29.1\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    return site


def test_the_default_run_trains(unloadable_torchvision: Path, tmp_path: Path) -> None:
    result = run_script(*TINY, "logger=none", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.json").is_file()


def test_resnet18_stops_with_one_line_naming_the_pair(unloadable_torchvision: Path,
                                                      tmp_path: Path) -> None:
    result = run_script("model=resnet18", "model.input_shape=[1,16,16]",
                        f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith(
        f"error: model: model=resnet18: torchvision 0.29.1 cannot load with torch "
        f"{torch.__version__} ({MISMATCH}); they are not built for each other. "
        f"Install the torchvision built for this torch: {matching_install(torch.__version__)}")
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_hidden_from_imports_and_metadata_once_it_failed(unloadable_torchvision: Path) -> None:
    """After hide_unloadable_torchvision: find_spec returns None, import and metadata say not
    found (what Lightning, torchmetrics and transformers take as absent: transformers calls
    find_spec and does not expect it to raise), and import_torchvision still names the failure."""
    program = """
import importlib.metadata, importlib.util
from gradreg.models.torchvision_import import hide_unloadable_torchvision, import_torchvision
hide_unloadable_torchvision()
import lightning
print(importlib.util.find_spec("torchvision"))
for lookup in (lambda: __import__("torchvision"),
               lambda: importlib.metadata.version("torchvision")):
    try:
        lookup()
    except (ModuleNotFoundError, importlib.metadata.PackageNotFoundError) as error:
        print(type(error).__name__)
try:
    import_torchvision("data=image_folder")
except ImportError as error:
    print(error)
"""
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[:3] == ["None", "ModuleNotFoundError", "PackageNotFoundError"]
    assert lines[3].startswith("data=image_folder: torchvision 0.29.1 cannot load with torch ")
    assert f"({MISMATCH})" in lines[3]
