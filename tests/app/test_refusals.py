"""Mistakes a user makes on the command line, each refused before training with one line on
stderr naming the problem and the fix, and status 2 (in-process runs of scripts/train.py): two
penalties under one name, an attack radius, seed or learning rate out of range, an override or
a config file that does not parse, a run folder that cannot be created, SLURM's launcher where
there is no cluster, dashboards made for another kind of model, a damaged image. A refused run
leaves no run folder behind."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from tests.lightning.data.images import write_image_folder, write_truncated_jpeg

from .helpers import one_error_line, run_in_process, run_script

A_SECOND_DOUBLE_BACKPROP = (
    "+penalties.double_backprop={_target_:gradreg.penalties.make_penalty,"
    "name:double_backprop,weight:0.5}")

REFUSED = {
    "two penalties under one name": (["penalty=double_backprop", A_SECOND_DOUBLE_BACKPROP], [
        "error: penalties.double_backprop: double_backprop is already the name of "
        "penalty=double_backprop, and the model takes one penalty per name (one would replace "
        "the other); give this one another name, e.g. +penalties.double_backprop_2=..."]),
    "negative fgsm_eps": (["model.fgsm_eps=-1"], [
        "error: model: fgsm_eps must be a finite number >= 0", "got -1"]),
    "nan fgsm_eps": (["model.fgsm_eps=nan"], ["error: model: fgsm_eps must be", "got nan"]),
    "negative seed": (["seed=-5"], [
        "error: seed: must be an integer from 0 to 4294967295 (numpy's seed range), got -5"]),
    "seed above numpy's range": (["seed=4294967296"], ["got 4294967296"]),
    "negative lr": (["model.optimizer.lr=-1"], [
        "error: model.optimizer.lr: must be a finite number > 0 (the optimizer's step size), "
        "got -1"]),
    "zero lr": (["model.optimizer.lr=0"], ["error: model.optimizer.lr: must be", "got 0"]),
    "nan lr": (["model.optimizer.lr=nan"], ["error: model.optimizer.lr: must be", "got nan"]),
    "GAN lr": (["experiment=gan_8gaussians_wgan_gp", "model.generator_optimizer.lr=-0.1"], [
        "error: model.generator_optimizer.lr: must be a finite number > 0", "got -0.1"]),
    "override with an open bracket": (["penalty.weight=[1,"], [
        "error: override 'penalty.weight=[1,' does not parse: no viable alternative at input "
        "'[1,'. Quote a value"]),
    "~ after =": (["data.root=~/pets"], [
        "error: override 'data.root=~/pets' does not parse: '~' at character 11 is not in "
        "Hydra's grammar", "write a home folder as $HOME/..."]),
    "no batch per optimizer step": (["trainer.accumulate_grad_batches=0"], [
        "error: trainer.accumulate_grad_batches: must be an integer >= 1 (batches per optimizer "
        "step), got 0"]),
    "negative gradient clipping": (["trainer.gradient_clip_val=-1"], [
        "error: trainer.gradient_clip_val: must be a finite number > 0, or null (0: no "
        "clipping), got -1"]),
    "validation never": (["+trainer.check_val_every_n_epoch=0"], [
        "error: trainer.check_val_every_n_epoch: must be an integer >= 1, or null, got 0"]),
    "negative workers": (["data.num_workers=-1"], [
        "error: data.num_workers: must be an integer >= 0 (0: batches are loaded in the "
        "training process), got -1"]),
    "misspelt key": (["penalty.wieght=1"], [
        "error: penalty.wieght: no such key in the configuration; did you mean penalty.weight? "
        "the keys of penalty are ['_target_', 'name', 'weight', 'every']"]),
    "misspelt group": (["penaly=r1"], [
        "error: penaly: no such key in the configuration; did you mean penalty? the keys at the "
        "top are ['seed',"]),
    "classifier with GAN dashboards": (["callbacks=gan_dashboards"], [
        "error: callbacks: InterpolatesGradientNorm (callbacks.interpolates) is for a GAN, but "
        "the model is a Classifier; use callbacks=dashboards"]),
    "GAN with classifier dashboards": (
        ["experiment=gan_8gaussians_wgan_gp", "callbacks=dashboards"], [
            "error: callbacks: SaliencyMaps (callbacks.saliency) is for a Classifier, but the "
            "model is a GAN on 2D points; use callbacks=gan_dashboards"]),
    "image GAN with the 2D GAN's dashboards": (["experiment=gan_digits_r1",
                                                "callbacks=gan_dashboards"], [
        "error: callbacks: CriticLandscape (callbacks.critic_landscape) is for a GAN on 2D "
        "points, but the model is a GAN on images; use callbacks=image_gan_dashboards"]),
}


def refused(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """stderr of a run of ``args`` that must end with status 2 and one line, no traceback
    (nothing before it: the seed is set without Lightning's ``Seed set to N`` line)."""
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(*args, tmp_path=tmp_path)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0] + "\n"


@pytest.mark.parametrize(("args", "messages"), REFUSED.values(), ids=REFUSED)
def test_refused_in_one_line(args: list[str], messages: list[str], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    err = refused(args, tmp_path / "run", capsys)
    for message in messages:
        assert message in err
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_a_config_file_that_is_not_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: yaml's ParserError as a traceback, status 1."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    broken = tmp_path / "configs" / "experiment" / "broken.yaml"
    broken.parent.mkdir(parents=True)
    broken.write_text("# a recipe\nmodel:\n  fgsm_eps: [0.1\n")
    err = refused([f"hydra.searchpath=[file://{tmp_path / 'configs'}]", "experiment=broken"],
                  tmp_path / "run", capsys)
    assert err.startswith(
        f"error: {broken}, line 3, column 13: not valid YAML (while parsing a flow sequence, "
        "expected ',' or ']', but got '<stream end>'); fix that line of the config file")


@pytest.mark.parametrize("multirun", [False, True])
def test_a_run_folder_behind_a_file(multirun: bool, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: NotADirectoryError from Hydra's mkdir as a traceback, status 1."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    (tmp_path / "a_file").write_text("")
    folder = tmp_path / "a_file" / "run"
    sweep = ["-m", "seed=0,1", f"hydra.sweep.dir={folder}"] if multirun else []
    err = refused(sweep, folder, capsys)
    assert err.startswith(
        f"error: hydra.run.dir: cannot create or write '{folder}' (Not a directory); choose a "
        "run folder you can write: hydra.run.dir=<folder> or paths.runs=<folder>")


def test_slurm_launcher_off_a_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: submitit's RuntimeError ('Could not detect "srun"') as a traceback, status 1."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    if shutil.which("sbatch") and shutil.which("srun"):
        pytest.skip("a SLURM node: the launcher can run here")
    err = refused(["-m", "hydra/launcher=submitit_slurm", "seed=0,1",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path / "run", capsys)
    plugin_installed = (importlib.util.find_spec("hydra_plugins") is not None and importlib.util
                        .find_spec("hydra_plugins.hydra_submitit_launcher") is not None)
    if not plugin_installed:
        # without the sweeps extra the plugin itself is missing, and that is the one line
        assert err == ("error: hydra/launcher=submitit_slurm needs Hydra's plugin "
                       "hydra-submitit-launcher, of the sweeps extra: pip install -e '.[sweeps]'"
                       "  (HYDRA_FULL_ERROR=1 shows the traceback)\n")
        return
    assert "error: hydra/launcher=submitit_slurm: " in err
    assert "not found on this machine" in err
    assert "hydra/launcher=submitit_local or hydra/launcher=joblib" in err
    assert not (tmp_path / "sweep").exists()


def test_a_truncated_jpeg_in_an_image_folder(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: PIL's OSError in a data-loading worker, mid-epoch."""
    pytest.importorskip("torchvision")
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    root = write_image_folder(tmp_path / "images", per_class=4)
    cut = write_truncated_jpeg(root / "red" / "cut.jpg")
    err = refused(["model=resnet18", "data=image_folder", f"data.root={root}",
                   "data.num_classes=3"], tmp_path / "run", capsys)
    assert err.startswith(f"error: data: {cut}: the image cannot be decoded (image file is "
                          "truncated")


def test_an_image_folder_with_the_default_model(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing folder is named first; an existing one with the default MLP (model.input_shape
    [64]) names the folder, model.input_shape and the models for images (checked before
    torchvision is imported). Before: only ``data.shape=[64] must be [1 or 3, S, S]``."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    missing = tmp_path / "nowhere"
    err = refused(["data=image_folder", f"data.root={missing}"], tmp_path / "run", capsys)
    assert err == (f"error: data: data.root={str(missing)!r} is not a folder; give a folder of "
                   "class sub-folders of images (root/<class>/<image>.png)  "
                   "(HYDRA_FULL_ERROR=1 shows the traceback)\n")
    root = write_image_folder(tmp_path / "images", per_class=1)
    err = refused(["data=image_folder", f"data.root={root}"], tmp_path / "run", capsys)
    assert err == (f"error: data: data.shape=[64] must be [1 or 3, S, S] for the images of "
                   f"{str(root)!r}; it is the model's input shape (model.input_shape): choose a "
                   "model for images, model=resnet18 ([3, 32, 32]) or model=cnn, or set "
                   "model.input_shape=[C, S, S] for a model of your own  "
                   "(HYDRA_FULL_ERROR=1 shows the traceback)\n")


@pytest.mark.parametrize("key", ["paths.runs", "hydra.run.dir"])
def test_a_quoted_home_in_a_folder_option(key: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a folder named ~ in the working directory."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(f'{key}="~/runs"', tmp_path=tmp_path / "run")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {key}=~/runs: ~ is not expanded here (a folder named ~ would "
                          f"be created in the working directory); write {key}=$HOME/runs")
    assert not (tmp_path / "~").exists()


def test_hydra_full_error_shows_hydra_own_exception(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """HYDRA_FULL_ERROR=1: the traceback, of the error and of Hydra's own exception under it."""
    from hydra.errors import OverrideParseException

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(Exception, match="override 'penalty.weight=.1,' does not") as error_info:
        run_in_process("penalty.weight=[1,", tmp_path=tmp_path)
    assert isinstance(error_info.value.__cause__, OverrideParseException)


@pytest.mark.parametrize("args", [
    pytest.param(["seed=-5"], id="checked value"),
    pytest.param(["model=cnn", "penalty=r1"], id="built object", marks=pytest.mark.slow),
])
def test_a_refused_run_leaves_no_folder(args: list[str], tmp_path: Path) -> None:
    """Refused before training (a value the checks refuse; a critic penalty the classifier
    refuses when it is built): status 2, one line, and nothing under paths.runs. Before: a run
    folder holding .hydra/ and train.log."""
    result = run_script(*args, f"paths.runs={tmp_path / 'runs'}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert one_error_line(result.stderr).startswith("error: ")
    assert not (tmp_path / "runs").exists()  # nor an empty runs folder


def test_a_refused_run_keeps_a_folder_named_on_the_command_line(tmp_path: Path) -> None:
    """hydra.run.dir may name a folder that existed before the run: it keeps its files."""
    named = tmp_path / "named"
    result = run_script("seed=-5", f"hydra.run.dir={named}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: seed: must be an integer" in (named / "train.log").read_text()
