"""scripts/train.py as users run it: a real training run, every experiment in one multirun
(subprocesses), and the configuration errors (in-process runs of the same ``__main__``)."""

from __future__ import annotations

import json
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from gradreg.app import run_names
from tests.lightning.data.images import write_image_folder

from .conftest import QUIET, SCRIPT, options
from .helpers import TINY, run_in_process, run_script

CLASSIFIER_METRICS = {f"{stage}/{name}" for stage in ("val", "test")
                      for name in ("loss", "acc", "acc_fgsm", "acc_pgd", "input_grad_norm")}
GAN_METRICS = {f"{stage}/{name}" for stage in ("val", "test")
               for name in ("energy_distance", "wasserstein")}
MODE_METRICS = {f"{stage}/{name}" for stage in ("val", "test") for name in ("modes",
                                                                             "high_quality")}
IMAGE_METRICS = {f"{stage}/{name}" for stage in ("val", "test")
                 for name in ("modes", "kl", "feature_energy_distance")}


def test_default_run_trains_and_reports_metrics_logs_and_checkpoint(tmp_path: Path) -> None:
    """The no-argument run, cut to 3 training batches: it prints the final metrics, the paths
    of its TensorBoard logs, checkpoint and metrics.json, and they exist, and the command that
    opens the logs (before: the folder only)."""
    result = run_script("trainer.max_epochs=1", "+trainer.limit_train_batches=3",
                        "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1",
                        "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(":", 1) for line in result.stdout.splitlines()[-4:])
    assert shlex.split(lines["open the logs"]) == ["tensorboard", "--logdir", str(tmp_path)]
    assert Path(lines["tensorboard logs"].strip()) == tmp_path
    assert any(tmp_path.glob("events.out.tfevents.*"))
    assert Path(lines["checkpoint"].strip()) == tmp_path / "checkpoints" / "epoch0-step3.ckpt"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "epoch0-step3.ckpt", "last.ckpt"]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics) == CLASSIFIER_METRICS | {"train/loss", "train/total",
                                                 "train/penalty/double_backprop"}
    assert all(0 <= metrics[f"test/{name}"] <= 1 for name in ("acc", "acc_fgsm"))
    assert metrics["test/acc_pgd"] <= metrics["test/acc_fgsm"] <= metrics["test/acc"]
    for name, value in metrics.items():
        assert f"  {name}" in result.stdout and f"{value:.4f}" in result.stdout


def printed_metrics(stdout: str) -> list[dict[str, float]]:
    """The metrics of each "final metrics:" block a run (or each job of a sweep) printed."""
    blocks = stdout.split("final metrics:\n")[1:]
    return [{name: float(value) for name, value in (line.split() for line in block.splitlines()
                                                    if line.startswith("  ")
                                                    and len(line.split()) == 2)}
            for block in blocks]


@pytest.mark.slow
def test_every_experiment_runs_in_one_multirun(tmp_path: Path) -> None:
    """``-m experiment=glob(*) debug=fast_dev_run``: one job per experiment config, each prints
    the metrics of its kind (classifier, GAN, GAN on a mixture) and, being a fast_dev_run,
    writes no file but the sweep's multirun.yaml: no metrics.json, .hydra/, log, checkpoint or
    scorer cache."""
    result = run_script("-m", "experiment=glob(*)", "debug=fast_dev_run",
                        "trainer.enable_progress_bar=false", f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    experiments = options("experiment")
    assert len(experiments) >= 6
    jobs = printed_metrics(result.stdout)
    assert len(jobs) == len(experiments)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [tmp_path / "multirun.yaml"]
    for printed, experiment in zip(jobs, experiments, strict=True):  # Hydra sorts glob matches
        metrics = set(printed)
        if experiment.startswith("gan_digits"):
            expected = GAN_METRICS | IMAGE_METRICS
        elif experiment.startswith("gan_"):
            expected = GAN_METRICS | (MODE_METRICS if "gaussians" in experiment else set())
        else:
            expected = CLASSIFIER_METRICS
        assert expected <= metrics, (experiment, expected - metrics)


def event_tags(log_dir: Path) -> dict[str, set[str]]:
    """Tags in the TensorBoard event files of ``log_dir``: scalars, images, and the HParams and
    text plugins' summaries."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir)).Reload()
    tags = {kind: set(events.Tags()[kind]) for kind in ("scalars", "images")}
    return tags | {plugin: set(events.PluginTagToContent(plugin)) for plugin in ("hparams",
                                                                                 "text")}


@pytest.mark.parametrize(("experiment", "penalties"), [("gan_digits_r1", {"r1"}),
                                                     ("gan_digits_wgan_gp", {"wgan_gp"}),
                                                     ("gan_digits_r3gan", {"r1", "r2"})])
def test_image_gan_experiments_train_score_and_show_samples(
        experiment: str, penalties: set[str], tmp_path: Path) -> None:
    """Each image GAN recipe, 3 critic steps: the scorer is trained and cached in the run
    directory, validation reports the classifier-based metrics, and TensorBoard gets sample
    grids, the HParams summaries and the autograd graph."""
    result = run_script(f"experiment={experiment}", "model.scorer.epochs=2",
                        "callbacks.samples.every_n_steps=1", *TINY, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics) >= GAN_METRICS | IMAGE_METRICS
    assert {name.split("/")[-1] for name in metrics if "/critic/" in name} == {
        "adversarial", *penalties}
    assert 1 <= metrics["test/modes"] <= 10 and metrics["test/kl"] >= 0
    assert (tmp_path / "scorer.pt").is_file()
    tags = event_tags(tmp_path)
    assert "samples" in tags["images"]
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= tags["hparams"]
    assert {"autograd_graph/text/text_summary", "autograd_graph/dot/text_summary"} == tags["text"]
    assert "test/kl" in tags["scalars"]


def test_resnet18_on_an_image_folder_with_three_penalties(tmp_path: Path) -> None:
    """``model=resnet18 data=image_folder`` on 30 PNGs in 3 class folders, debug=fast_dev_run:
    double backprop on the inputs, a penalty on the hidden block ``layer2`` and the Jacobian,
    unchanged from the small models; the run reports accuracy under FGSM and PGD."""
    pytest.importorskip("torchvision")
    root = write_image_folder(tmp_path / "images")
    result = run_script(
        "model=resnet18", "data=image_folder", f"data.root={root}", "data.num_classes=3",
        "data.batch_size=8", "debug=fast_dev_run", "model.pgd_steps=2",
        "+penalties.hidden={_target_:gradreg.penalties.make_penalty,name:intermediate,"
        "weight:0.01,layers:[layer2]}",
        "+penalties.jacobian={_target_:gradreg.penalties.make_penalty,name:jacobian,weight:0.01}",
        "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    (metrics,) = printed_metrics(result.stdout)  # a fast_dev_run prints its metrics only
    assert set(metrics) == CLASSIFIER_METRICS | {"train/loss", "train/total"} | {
        f"train/penalty/{name}" for name in ("double_backprop", "hidden", "jacobian")}
    assert all(metrics[f"train/penalty/{name}"] > 0 for name in ("hidden", "jacobian"))
    assert metrics["train/total"] > metrics["train/loss"]
    assert all(0 <= metrics[f"test/{name}"] <= 1 for name in ("acc", "acc_fgsm", "acc_pgd"))


def test_image_gan_on_an_image_folder(tmp_path: Path) -> None:
    """``experiment=gan_digits_r1 data=image_folder``: the recipe on the user's images (RGB
    16x16 here); the scorer learns their 3 classes, so at most 3 modes are hit."""
    pytest.importorskip("torchvision")
    root = write_image_folder(tmp_path / "images")
    result = run_script("experiment=gan_digits_r1", "data=image_folder", f"data.root={root}",
                        "data.num_classes=3", "data.shape=[3,16,16]", "data.batch_size=8",
                        "model.scorer.epochs=2", *TINY, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 1 <= metrics["test/modes"] <= 3 and metrics["test/kl"] >= 0


BAD_CONFIGS = {
    # Hydra's error listed the options over many lines (status 1)
    "unknown penalty": (["penalty=foo"], 2, [
        "error: penalty=foo: no such option; the options of penalty are ['approx_r1', ",
        "'double_backprop'", "'wgan_gp'", "'none'"]),
    "unknown model": (["model=resnet"], 2, [
        "error: model=resnet: no such option; did you mean model=resnet18? the options of model "
        "are ['cnn', 'dcgan', 'gan', 'mlp', 'resnet18'"]),
    "unknown preset name": (["penalty.name=foo"], 2, [
        "error: penalty: unknown penalty preset 'foo'; known presets: wgan_gp, wgan_lp, r1"]),
    "critic penalty for a classifier": (["penalty=wgan_gp"], 2, [
        "error: model: penalty 'wgan_gp' has points='interpolates', which a Classifier cannot",
        "supports points ['inputs', 'activations', 'parameters'], i.e. the presets "
        "['double_backprop', 'intermediate', 'jacobian', 'param_grad_norm', 'sam', 'asam', "
        "'gr', 'derivative', 'spectral']"]),
    "negative weight": (["penalty.weight=-1"], 2, [
        "error: penalty: weight must be a finite number >= 0, got -1"]),
    "n_critic below 1": (["experiment=gan_8gaussians_wgan_gp", "model.n_critic=0"], 2, [
        "error: model: n_critic must be an integer >= 1, got 0"]),
    "unknown activation": (["model.backbone.activation=gelu"], 2, [
        "error: model: activation='gelu' is unknown; valid values: ['elu', 'leaky_relu'"]),
    "penalty method the model refuses": (["+penalty.method=finite_difference"], 2, [
        "error: training: method='finite_difference' on a piecewise-linear model (Relu in its "
        "graph)"]),
    "a run that diverges": (["model.optimizer.lr=1e20"], 2, [
        "error: training: the outputs of call 2 contain NaN or Inf although the points are "
        "finite"]),
    # each of these was a traceback, a bare AssertionError, or a run that trained anyway
    "seed not a number": (["seed=abc"], 2, [
        "error: seed: must be an integer from 0 to 4294967295 (numpy's seed range), got 'abc'"]),
    "max_epochs not a number": (["trainer.max_epochs=abc"], 2, [
        "error: trainer.max_epochs: must be an integer >= 1", "got 'abc'"]),
    "max_epochs -1 trains forever": (["trainer.max_epochs=-1"], 2, [
        "error: trainer.max_epochs: must be an integer >= 1", "set +trainer.max_steps=<N>",
        "got -1"]),
    "max_epochs 0 reports an untrained model": (["trainer.max_epochs=0"], 2, [
        "0 would report the untrained model's metrics as results", "got 0"]),
    "batch size 0": (["data.batch_size=0"], 2, [
        "error: data.batch_size: must be an integer >= 1, got 0"]),
    "unwritable output folder": (["paths.output_dir=/etc/passwd/out"], 2, [
        "error: paths.output_dir: cannot write to '/etc/passwd/out' (Not a directory); choose a "
        "folder you can write"]),
    "missing checkpoint": (["ckpt_path=nowhere.ckpt"], 2, [
        "error: ckpt_path: 'nowhere.ckpt' is not a file; pass a checkpoint"]),
}


BAD_IMAGE_FOLDERS = {
    "no data.root": (["model=resnet18", "data=image_folder"], [
        "error: data: data.root is not set; give the folder of class sub-folders of images: "
        "data=image_folder data.root=<folder>"]),
    "missing folder": (["model=resnet18", "data=image_folder", "data.root=nowhere"], [
        "error: data: data.root='nowhere' is not a folder; give a folder of class sub-folders"]),
    "class count": (["model=resnet18", "data=image_folder", "data.root={images}"], [
        "has 3 class folders ['blue', 'red', 'white'], but data.num_classes=10; set "
        "data.num_classes=3"]),
}


@pytest.mark.parametrize(("args", "messages"), BAD_IMAGE_FOLDERS.values(), ids=BAD_IMAGE_FOLDERS)
def test_bad_image_folder_exits_with_one_line(
    args: list[str], messages: list[str], tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torchvision")
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)  # a relative data.root is relative to where the user runs
    images = write_image_folder(tmp_path / "images", per_class=2)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(*(arg.format(images=images) for arg in args), tmp_path=tmp_path / "run")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    for message in messages:
        assert message in err


@pytest.mark.parametrize(("args", "status", "messages"), BAD_CONFIGS.values(), ids=BAD_CONFIGS)
def test_bad_configuration_exits_nonzero_naming_key_and_valid_values(
    args: list[str], status: int, messages: list[str], tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(*args, tmp_path=tmp_path)
    assert exit_info.value.code == status
    err = capsys.readouterr().err
    for message in messages:
        assert message in err
    if status == 2:  # our own errors: one line, no traceback
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_hydra_full_error_shows_the_exception(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(Exception, match="penalty: weight must be") as error_info:
        run_in_process("penalty.weight=-1", tmp_path=tmp_path)
    assert isinstance(error_info.value.__cause__, ValueError)


@pytest.mark.parametrize(("trainer", "strategy", "fix"), [
    ("ddp_cpu", "DDPStrategy", "use trainer=ddp_spawn_cpu (or trainer.strategy=ddp_spawn"),
    ("fsdp_cpu", "ShardedPenaltyStrategy",
     "ShardedPenaltyStrategy has no launcher that starts the ranks inside the job, so run each "
     "job without -m, one command per value (e.g. python scripts/train.py trainer=fsdp_cpu "
     "seed=0, then seed=1), or sweep with trainer=ddp_spawn_cpu, which does not shard"),
])
def test_multirun_refuses_a_launcher_that_reruns_the_script(
    trainer: str, strategy: str, fix: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under -m, a trainer whose strategy re-launches the script per rank stops before any rank
    starts and names what to do instead: DDP has a launcher inside the job (ddp_spawn), the
    sharded strategy has none (its jobs run without -m)."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process("-m", f"trainer={trainer}", "seed=0,1", f"hydra.sweep.dir={tmp_path}",
                       tmp_path=tmp_path)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: trainer: strategy {strategy} (trainer={trainer}) re-launches "
                          "the command line for each extra rank")
    assert fix in err
    assert not (tmp_path / "0" / "metrics.json").exists()


def test_run_folders_are_named_after_the_overrides(tmp_path: Path) -> None:
    """Before: runs were <date>/<time> and sweep jobs 0, 1: nothing said which was which."""
    result = run_script("penalty=none", "seed=1", *TINY, f"paths.runs={tmp_path}",
                        "logger=none")
    assert result.returncode == 0, result.stderr[-3000:]
    (folder,) = tmp_path.glob("*/*")
    assert "+penalty:none+seed:1" in folder.name and "logger:none" in folder.name
    assert len(folder.name) <= 9 + 120 + 4


def test_run_folder_names_keep_whole_overrides_and_no_slashes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    suffix = run_names.run_folder_suffix
    monkeypatch.setattr(run_names.sys, "argv", ["train.py", "-m", "penalty=none,r1", "seed=1",
                                              "+x=range(2)"])
    assert run_names.swept_keys(run_names.sys.argv) == {"penalty", "x"}
    assert suffix("penalty:r1+seed:1++x:0", only_swept=True) == "_penalty:r1+x:0"
    assert suffix("seed:1", only_swept=True) == ""
    assert suffix("") == ""
    assert suffix("data.root:~_pets+penalty:none") == "_data.root:~_pets+penalty:none"
    assert suffix("a:x_y,z+b:c_d") == "_a:x_y_z+b:c_d"
    assert suffix("model.input_shape:[1,16,16]+seed:1") == "_model.input_shape:[1_16_16]+seed:1"
    assert suffix("a:1+b:2+c:3", limit=7) == "_a:1+b:2+..."
    assert suffix("lr:1e+20+weight:0.1") == "_lr:1e+20+weight:0.1"  # an exponent's sign stays


def test_a_fast_dev_run_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``debug=fast_dev_run`` writes no file; before, the run folder Hydra made stayed, empty."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "debug=fast_dev_run", *QUIET,
                                      f"paths.runs={tmp_path / 'runs'}",
                                      "trainer.enable_progress_bar=false"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    assert not (tmp_path / "runs").exists()
