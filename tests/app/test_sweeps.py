"""Sweeps through Hydra's plugins (the sweeps extra), run as users run them: a 3-trial Optuna
study over the penalty weight and lr of each recipe (``hparams_search=...``), the jobs of a
search in parallel processes (``hydra/launcher=joblib``), and jobs submitted through submitit
(its local executor: the submission a SLURM cluster gets, run as local processes). Budget: a few
batches per trial, one thread."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from gradreg.app.sweeps import results as sweep_results
from gradreg.app.sweeps import space as sweep_space
from gradreg.app.sweeps import table as sweep_table
from gradreg.app.sweeps.figure import metric_vs_weight_figure
from gradreg.app.sweeps.results import read_jobs
from gradreg.app.sweeps.summary import SweepSummary

from .conftest import CONFIGS, ROOT
from .helpers import TINY, hparams, run_in_process, run_script, start

PLUGINS = ("optuna", "hydra_plugins.hydra_joblib_launcher",
           "hydra_plugins.hydra_submitit_launcher")
needs_extra = pytest.mark.skipif(
    not all(sweep_space.plugin_installed(name) for name in PLUGINS),
    reason="needs the sweeps extra (Optuna, Hydra's joblib and submitit launchers): "
           "pip install -e '.[sweeps]'")

# per trial: a few batches on one thread; PGD with 2 steps
TRIAL = [*TINY, "threads=1", "model.pgd_steps=2"]
GAN_TRIAL = [*TINY, "threads=1"]


def trials(sweep_dir: Path) -> dict[Path, tuple[dict[str, str], dict[str, float]]]:
    """Each trial's run folder (in job order) -> (its overrides, as in .hydra/overrides.yaml;
    its metrics.json)."""
    return {folder: (dict(item.split("=", 1)
                          for item in OmegaConf.load(folder / ".hydra" / "overrides.yaml")),
                     json.loads((folder / "metrics.json").read_text()))
            for folder in sorted(path.parent for path in sweep_dir.glob("*/.hydra"))}


def check_study(result: subprocess.CompletedProcess, sweep_dir: Path, metric: str,
                direction: str, lr_key: str, n_trials: int) -> None:
    """The study ran ``n_trials`` runs, each in a folder named after its lr and weight, with
    the optimized metric in its metrics.json; the best trial is the one with the highest
    (``direction="maximize"``) or lowest value in those files, printed in one line and saved as
    best_trial.txt."""
    assert result.returncode == 0, result.stderr[-3000:]
    runs = trials(sweep_dir)
    assert len(runs) == n_trials
    for folder, (overrides, metrics) in runs.items():
        weight, lr = float(overrides["penalty.weight"]), float(overrides[lr_key])
        # the penalty and its weight first, then the other swept key
        assert re.fullmatch(r"\d+_[a-z0-9_]+:[0-9.e+-]+_" + re.escape(lr_key) + r":[0-9.e+-]+",
                            folder.name), folder.name
        assert f":{weight:.4g}_" in folder.name
        assert folder.name.endswith(f"_{lr_key}:{lr:.4g}")
        assert metric in metrics
    best = max if direction == "maximize" else min
    best_folder = best(runs, key=lambda folder: runs[folder][1][metric])
    results = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert results.best_value == pytest.approx(runs[best_folder][1][metric])
    assert {key: str(value) for key, value in results.best_params.items()} == {
        key: runs[best_folder][0][key] for key in ("penalty.weight", lr_key)}
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("best trial:")]
    assert line == (f"best trial: penalty.weight={runs[best_folder][0]['penalty.weight']} "
                    f"{lr_key}={runs[best_folder][0][lr_key]} -> "
                    f"{metric}={results.best_value:.4f} "
                    f"({direction}), {best_folder}")
    assert (sweep_dir / "best_trial.txt").read_text() == line + "\n"


@needs_extra
def test_a_diverged_trial_fails_alone_and_the_study_goes_on(tmp_path: Path) -> None:
    """4 trials over lr in {0.001, 1e20} (TPE's seeded start draws 1e20, 0.001, 1e20, 1e20): the
    trials at lr 1e20 diverge (a NaN output, NonFiniteError), each is recorded as failed with one
    line naming it, and the study goes on to the end; the best trial is the one that trained."""
    space = ('hydra.sweeper.params={model.optimizer.lr:"choice(0.001,1e20)",'
             'penalty.weight:"choice(0.1)"}')
    result = run_script("-m", "hparams_search=classifier_robustness", space,
                        "hydra.sweeper.n_trials=4", *TRIAL, f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    folders = sorted(path.parent.name for path in tmp_path.glob("*/.hydra"))
    assert folders == [f"{index:03d}_double_backprop:0.1_model.optimizer.lr:{lr}" for index, lr in
                       enumerate(["1e+20", "0.001", "1e+20", "1e+20"])]
    assert [(tmp_path / name / "metrics.json").is_file() for name in folders] == [
        False, True, False, False]
    assert result.stderr.count("error: training diverged, this trial fails and the search goes "
                               "on: the outputs of call") == 3
    best = OmegaConf.load(tmp_path / "optimization_results.yaml").best_params
    assert best["model.optimizer.lr"] == 0.001
    assert "best trial: penalty.weight=0.1 model.optimizer.lr=0.001 -> val/acc_pgd=" in (
        result.stdout)


def with_hydra_config(overrides: list[str]) -> DictConfig:
    """configs/train.yaml with ``overrides``, and its ``hydra`` node (sweeper, launcher)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=True)


@needs_extra
def test_optuna_study_of_the_classifier_prints_and_saves_the_best_weight(tmp_path: Path) -> None:
    """``-m hparams_search=classifier_robustness``, 3 trials: each trial's folder and TensorBoard
    run say its weight and lr, its HParams row has them, and the best trial (the highest
    validation accuracy under PGD of the three metrics.json) is printed and saved."""
    result = run_script("-m", "hparams_search=classifier_robustness", "hydra.sweeper.n_trials=3",
                        *TRIAL, f"hydra.sweep.dir={tmp_path}")
    check_study(result, tmp_path, "val/acc_pgd", "maximize", "model.optimizer.lr", n_trials=3)
    for folder, (overrides, metrics) in trials(tmp_path).items():
        weight, lr = float(overrides["penalty.weight"]), float(overrides["model.optimizer.lr"])
        assert 0.001 <= weight <= 10 and 0.0001 <= lr <= 0.01  # the recipe's search space
        assert 0 <= metrics["val/acc_pgd"] <= 1
        row = hparams(folder)
        assert (row["weight"], row["lr"], row["penalty"]) == (weight, lr, "double_backprop")
    # the study's folder has one HParams declaration, in its summary run: the optimized metric
    # first, the swept weight and lr as the columns that differ
    assert len(list(tmp_path.rglob("events.out.tfevents.*_hparams_folder"))) == 1
    content = EventAccumulator(str(tmp_path / "summary")).Reload().PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/experiment"]).experiment
    assert experiment.metric_infos[0].name.tag == "val/acc_pgd"
    differ = {info.name for info in experiment.hparam_infos if info.differs}
    assert {"weight", "lr", "weight_log10", "lr_log10"} <= differ and "seed" not in differ
    assert not list(tmp_path.rglob("*_hparams_run"))
    assert (tmp_path / "summary.md").is_file()


@pytest.mark.slow
@needs_extra
def test_optuna_study_of_the_gan_runs_its_trials_in_parallel_through_joblib(
        tmp_path: Path) -> None:
    """``-m hparams_search=gan_quality hydra/launcher=joblib``: 2 trials asked for at once and
    run in 2 processes; the best is the lowest validation energy distance."""
    result = run_script("-m", "hparams_search=gan_quality", "hydra/launcher=joblib",
                        "hydra.launcher.n_jobs=2", "hydra.sweeper.n_jobs=2",
                        "hydra.sweeper.n_trials=2", *GAN_TRIAL, f"hydra.sweep.dir={tmp_path}")
    check_study(result, tmp_path, "val/energy_distance", "minimize", "model.generator_optimizer.lr",
                n_trials=2)
    assert "Joblib.Parallel(n_jobs=2," in result.stdout + result.stderr
    for folder, (overrides, _) in trials(tmp_path).items():
        row = hparams(folder)
        assert (row["weight"], row["generator_lr"], row["lr"]) == (
            float(overrides["penalty.weight"]),
            *[float(overrides["model.generator_optimizer.lr"])] * 2)


@pytest.mark.slow
@needs_extra
def test_submitit_local_runs_each_job_as_a_submitted_process(tmp_path: Path) -> None:
    """``hydra/launcher=submitit_local``: the jobs are pickled, submitted and run in processes
    of their own (as on SLURM), which find the app's modules and name their folders after the
    swept key; each job's output is in submitit's log, and its metrics are those of the same
    job run by Hydra's default launcher (in the sweep's own process)."""
    args = ["penalty.weight=0.03,0.3", *TRIAL, "logger=none", "callbacks=none"]
    result = run_script("-m", "hydra/launcher=submitit_local", *args,
                        f"hydra.sweep.dir={tmp_path / 'submitit'}")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = trials(tmp_path / "submitit")
    assert [folder.name for folder in runs] == ["000_double_backprop:0.03",
                                                "001_double_backprop:0.3"]
    assert all(metrics["train/penalty/double_backprop"] > 0 for _, metrics in runs.values())
    logs = sorted((tmp_path / "submitit").glob(".submitit/*/*_0_log.out"))
    assert len(logs) == 2
    assert all("final metrics:" in log.read_text() for log in logs)
    result = run_script("-m", *args, f"hydra.sweep.dir={tmp_path / 'basic'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [metrics for _, metrics in trials(tmp_path / "basic").values()] == [
        metrics for _, metrics in runs.values()]


@needs_extra
def test_submitit_slurm_submits_the_same_config_to_a_cluster(tmp_path: Path) -> None:
    """``hydra/launcher=submitit_slurm`` composes with the app's config (no cluster here: what
    sbatch would get is checked, not run)."""
    cfg = with_hydra_config(["hydra/launcher=submitit_slurm",
                             "hparams_search=classifier_robustness",
                             "hydra.launcher.partition=cpu", f"hydra.sweep.dir={tmp_path}"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.partition, launcher.timeout_min, launcher.nodes) == ("cpu", 60, 1)
    assert launcher.submitit_folder == f"{tmp_path}/.submitit/%j"
    assert cfg.hydra.sweeper.params["penalty.weight"] == "tag(log, interval(0.001, 10.0))"


@needs_extra
@pytest.mark.parametrize(("recipe", "metric", "direction"), [
    ("classifier_robustness", "val/acc_pgd", "maximize"),
    ("gan_quality", "val/energy_distance", "minimize")])
def test_each_recipe_searches_weight_and_lr_on_a_validation_metric(
        recipe: str, metric: str, direction: str, tmp_path: Path) -> None:
    cfg = with_hydra_config([f"hparams_search={recipe}", f"paths.output_dir={tmp_path}"])
    assert (cfg.optimized_metric, cfg.hydra.sweeper.direction) == (metric, direction)
    assert metric.startswith("val/")
    assert set(cfg.hydra.sweeper.params) == {"penalty.weight", next(
        key for key in ("model.optimizer.lr", "model.generator_optimizer.lr")
        if OmegaConf.select(cfg, key) is not None)}
    assert all(space.startswith("tag(log, interval(") for space in cfg.hydra.sweeper.params
               .values())
    assert "hparams" in cfg.callbacks  # the HParams table compares the trials


def test_a_metric_the_run_does_not_log_is_one_line_naming_those_it_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(*TINY, "logger=none", "callbacks=none", "model.pgd_steps=0",
                       "optimized_metric=val/acc_pgdd", tmp_path=tmp_path)
    assert exit_info.value.code == 2
    # one line, the last on stderr (Lightning's own lines before it reach the captured stderr
    # where this test is the first in the process to import Lightning)
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith("error: optimized_metric: the run logged no metric 'val/acc_pgdd'; "
                           "it logged ['test/acc', 'test/acc_fgsm', ")
    assert err.endswith(f"{line}\n")


@pytest.mark.parametrize(("args", "message"), [
    (["-m", "hparams_search=gan_quality"], "hparams_search=gan_quality needs optuna, of the "
                                           "sweeps extra"),
    (["-m", "hydra/launcher=submitit_slurm", "seed=0,1"],
     "hydra/launcher=submitit_slurm needs Hydra's plugin hydra-submitit-launcher"),
    (["-m", "hydra/launcher=joblib", "seed=0,1"],
     "hydra/launcher=joblib needs Hydra's plugin hydra-joblib-launcher"),
    (["logger=[tensorboard,mlflow]"], "logger=mlflow needs mlflow, of the trackers extra: "
                                      "pip install -e '.[trackers]'"),
    (["logger=wandb"], "logger=wandb needs wandb, of the trackers extra")])
def test_a_plugin_that_is_not_installed_is_one_line_naming_the_extra(
        args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: Hydra's "Could not find 'hydra/launcher/joblib'", which names no package."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sweep_space, "plugin_installed", lambda name: False)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(*args, tmp_path=tmp_path)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert "pip install -e '.[sweeps]'" in err or "pip install -e '.[trackers]'" in err


def test_a_search_recipe_without_multirun_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without -m a recipe would train once with the config's own weight and search nothing."""
    pytest.importorskip("optuna")
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process("hparams_search=classifier_robustness", tmp_path=tmp_path)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: hparams_search: classifier_robustness is a search of several runs, which Hydra "
        "starts with -m: python scripts/train.py -m hparams_search=classifier_robustness  "
        "(HYDRA_FULL_ERROR=1 shows the traceback)\n")
    assert not (tmp_path / "metrics.json").exists()


@needs_extra
@pytest.mark.parametrize(("url", "reason"), [
    ("sqlite:////nonexistent/folder/study.db", "(sqlite3.OperationalError) unable to open "
                                               "database file"),
    ("postgresql://user@localhost:1/study", "Failed to import DB access module")])
def test_a_storage_that_cannot_be_opened_is_refused_before_any_trial(
        url: str, reason: str, tmp_path: Path) -> None:
    """A folder that does not exist; a database whose driver is not installed: one line, status
    2, no sweep folder."""
    result = run_script("-m", "hparams_search=classifier_robustness",
                        f"hydra.sweeper.storage={url}", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: hydra.sweeper.storage: cannot open {url}: {reason}")
    assert result.stderr.count("\n") == 1 and "sqlite:///path/study.db" in result.stderr
    assert not (tmp_path / "sweep").exists()


def study_trials(url: str, name: str) -> list:
    """The trials of the study ``name`` in the storage ``url``, in order."""
    import optuna

    return optuna.load_study(study_name=name, storage=url).get_trials()


@needs_extra
def test_a_search_prunes_trials_from_their_validation_metric(tmp_path: Path) -> None:
    """With a pruner that prunes every value below 2 (accuracy never reaches it), each trial
    reports val/acc_pgd after its first epoch and stops there: one line, no metrics.json, the
    trial PRUNED in the study (a storage URL given: the database outside the sweep folder),
    with its reported value equal to the metric of that validation; no best trial."""
    import optuna

    url = f"sqlite:///{tmp_path / 'study.db'}"
    result = run_script("-m", "hparams_search=classifier_robustness", "hydra.sweeper.n_trials=2",
                        f"hydra.sweeper.storage={url}", "trainer.max_epochs=3",
                        "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner",
                        "~hydra.sweeper.pruner.n_startup_trials",
                        "~hydra.sweeper.pruner.n_warmup_steps", "+hydra.sweeper.pruner.lower=2",
                        *TRIAL[1:], "callbacks=default", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert result.returncode == 0, result.stderr[-3000:]
    trials_ = study_trials(url, "classifier_robustness")
    assert [trial.state for trial in trials_] == [optuna.trial.TrialState.PRUNED] * 2
    assert [list(trial.intermediate_values) for trial in trials_] == [[0], [0]]
    for trial in trials_:
        assert f"trial {trial.number} pruned after epoch 0: val/acc_pgd=" \
               f"{trial.intermediate_values[0]:.4f}" in result.stdout
    folders = sorted((tmp_path / "sweep").glob("*/.hydra"))
    assert len(folders) == 2 and not any((f.parent / "metrics.json").exists() for f in folders)
    assert not (tmp_path / "sweep" / "optuna.db").exists()
    assert "best trial:" not in result.stdout


@pytest.mark.slow
@needs_extra
def test_a_search_killed_mid_trial_resumes_without_repeating_its_finished_trials(
        tmp_path: Path) -> None:
    """``kill -9`` of the search while its second trial trains; the same command again (the same
    sweep folder, so the same optuna.db) keeps trial 0, records trial 1 as failed, tries its
    parameters again as trial 2 and ends with trial 3: 3 trials ended in all, trial 0 run
    once."""
    import optuna

    args = ["-m", "hparams_search=classifier_robustness", "hydra.sweeper.n_trials=3",
            "trainer.max_epochs=30", *TRIAL[1:], "logger=none", "callbacks=default",
            f"hydra.sweep.dir={tmp_path}"]
    process = start(*args)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("001_*/checkpoints/*.ckpt")):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the second trial never checkpointed an epoch"
        time.sleep(0.05)
    process.kill()
    process.communicate(timeout=60)
    first = (tmp_path / next(tmp_path.glob("000_*")).name / "metrics.json").stat().st_mtime_ns
    result = run_script(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(2 trials before, resumed)" in result.stdout
    trials_ = study_trials(f"sqlite:///{tmp_path / 'optuna.db'}", "classifier_robustness")
    states = optuna.trial.TrialState
    assert [trial.state for trial in trials_] == [states.COMPLETE, states.FAIL, states.COMPLETE,
                                                  states.COMPLETE]
    assert trials_[2].params == trials_[1].params
    assert trials_[2].user_attrs["retry_of"] == 1
    folders = sorted(path.parent.name for path in tmp_path.glob("*/.hydra"))
    assert [name[:4] for name in folders] == ["000_", "001_", "002_", "003_"]
    assert [(tmp_path / name / "metrics.json").exists() for name in folders] == [
        True, False, True, True]
    assert (tmp_path / folders[0] / "metrics.json").stat().st_mtime_ns == first
    assert folders[2].split("_", 1)[1] == folders[1].split("_", 1)[1]  # the same parameters


def test_swept_keys_come_from_the_command_line_or_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job in a process of its own (joblib, submitit) has another command line: the keys
    come from the environment its sweep set."""
    argv = ["train.py", "-m", "--cfg", "job", "penalty=none,r1", "seed=1",
            "penalty.weight=interval(0.1,1)"]
    monkeypatch.delenv(sweep_space.SWEPT_KEYS_VARIABLE, raising=False)
    assert sweep_space.swept_keys(argv) == {"penalty", "penalty.weight"}
    assert sweep_space.swept_keys(["train.py", "-m", "penalty=["]) == set()  # Hydra says why
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with sweep_space.jobs_environment(argv):
        assert sweep_space.swept_keys(["-m", "submitit.core._submit", "folder"]) == {
            "penalty", "penalty.weight"}
        # the checkout's root, whose gradreg the jobs import; no folder of gradreg's own (its
        # gradreg/lightning would hide the lightning package from a DDP rank or a job)
        assert os.environ["PYTHONPATH"] == str(ROOT)
    assert sweep_space.SWEPT_KEYS_VARIABLE not in os.environ and "PYTHONPATH" not in os.environ


# a sweep of penalty=none,double_backprop penalty.weight=0.1,1 seed=0,1,2 as an earlier grid
# sweeper wrote it (none ignores the weight: its two jobs per seed measure the same, and count as
# one seed), plus a 4th seed of weight 1 that failed. Validation chooses, test reports.
VAL_PGD = {("none", 0): 0.50, ("none", 1): 0.52, ("none", 2): 0.48,
           ("0.1", 0): 0.60, ("0.1", 1): 0.64, ("0.1", 2): 0.62,
           ("1", 0): 0.62, ("1", 1): 0.66, ("1", 2): 0.64}
ACC_PGD = {("none", 0): 0.50, ("none", 1): 0.52, ("none", 2): 0.48,
           ("0.1", 0): 0.60, ("0.1", 1): 0.64, ("0.1", 2): 0.62,
           ("1", 0): 0.61, ("1", 1): 0.66, ("1", 2): 0.68}
# validation accuracy: none and λ=0.1 0.0001 apart, a tie as shown
VAL_ACC = {("none", 0): 0.9000, ("none", 1): 0.9200, ("none", 2): 0.9400,
           ("0.1", 0): 0.9001, ("0.1", 1): 0.9201, ("0.1", 2): 0.9401,
           ("1", 0): 0.80, ("1", 1): 0.83, ("1", 2): 0.83}
ACC = {("none", 0): 0.90, ("none", 1): 0.92, ("none", 2): 0.94,
       ("0.1", 0): 0.91, ("0.1", 1): 0.90, ("0.1", 2): 0.95,
       ("1", 0): 0.80, ("1", 1): 0.83, ("1", 2): 0.83}


def synthetic_sweep(folder: Path) -> None:
    """The job folders the app writes (``.hydra/config.yaml``, ``.hydra/overrides.yaml``,
    ``metrics.json``) of the sweep above, with the numbers of :data:`VAL_PGD`, :data:`ACC_PGD`,
    :data:`VAL_ACC` and :data:`ACC`."""
    jobs = [("none", weight, seed) for weight in ("0.1", "1") for seed in range(3)]
    jobs += [("double_backprop", weight, seed) for weight in ("0.1", "1") for seed in range(3)]
    jobs += [("double_backprop", "1", 3)]
    for number, (penalty, weight, seed) in enumerate(jobs):
        job = folder / f"{number:03d}_{penalty}_seed:{seed}"
        (job / ".hydra").mkdir(parents=True)
        config = {"seed": seed, "penalty": {"name": penalty, "weight": float(weight)}}
        OmegaConf.save(OmegaConf.create(config), job / ".hydra" / "config.yaml")
        OmegaConf.save(OmegaConf.create([f"penalty={penalty}", f"penalty.weight={weight}",
                                         f"seed={seed}", "trainer.max_epochs=1"]),
                       job / ".hydra" / "overrides.yaml")
        key = ("none" if penalty == "none" else weight, seed)
        if key in ACC:
            (job / "metrics.json").write_text(json.dumps(
                {"test/acc": ACC[key], "test/acc_pgd": ACC_PGD[key], "val/acc": VAL_ACC[key],
                 "val/acc_pgd": VAL_PGD[key], "train/loss": 1.0}))


def run_summary(sweep_dir: Path, optimized: str | None = None) -> None:
    """The sweep callback's end, as Hydra calls it."""
    config = OmegaConf.create({"optimized_metric": optimized,
                               "hydra": {"sweep": {"dir": str(sweep_dir)}, "sweeper": {}}})
    SweepSummary().on_multirun_end(config)


def test_the_student_t_quantiles_of_the_intervals() -> None:
    """t(0.975, n - 1) from tables: 12.706 (1 degree of freedom), 4.303 (2), 2.776 (4),
    2.262 (9)."""
    assert [round(sweep_results.t_quantile(n), 3) for n in (2, 3, 5, 10)] == [
        12.706, 4.303, 2.776, 2.262]


def test_the_summary_chooses_on_validation_and_reports_on_test_against_baseline_and_runner_up(
        tmp_path: Path) -> None:
    """test/acc_pgd, chosen on val/acc_pgd: λ=1 (val 0.62, 0.66, 0.64: 0.640 ± 0.020) over the
    runner-up λ=0.1 (0.620), although the baseline row's numbers repeat on test. On test, λ=1
    (0.61, 0.66, 0.68: 0.650 ± 0.036) differs from the baseline (0.50, 0.52, 0.48) by 0.11,
    0.14, 0.20: Δ = 0.15, SD(d) = √0.0021 = 0.045826, SE = 0.026458, h = 4.3027·SE = 0.11384:
    the interval +0.036 to +0.264 excludes 0, bold. Against the runner-up (0.60, 0.64, 0.62):
    d = 0.01, 0.02, 0.06, Δ = 0.03, SD = √0.0007 = 0.026458, SE = 0.015275, h = 0.065725:
    -0.036 to +0.096, within the noise. λ=0.1 against the baseline: d = 0.10, 0.12, 0.14, SD
    0.02, h = 4.3027·0.02/√3 = 0.049683. test/acc: none and λ=0.1 are 0.0001 apart on
    validation (0.920 ± 0.020 both as shown): a tie, nothing chosen, nothing bold. The
    baseline's 6 jobs are 3 seeds; λ=1's failed 4th seed is 3/4."""
    synthetic_sweep(tmp_path)
    run_summary(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith(f"# sweep {tmp_path}\n\nPer metric, the setting is chosen on the "
                              "validation split")
    assert ("t(0.975, n − 1) · SD(differences) / √n over n seeds (t = 12.71 for 2 seeds, "
            "t = 4.30 for 3 seeds, t = 3.18 for 4 seeds, t = 2.78 for 5 seeds)") in summary
    assert "A difference exceeds the noise where that interval excludes 0." in summary
    assert "Seeds 0, 1, 2, 3; baseline: penalty=none (λ = 0).\n" in summary
    assert summary.endswith(
        "## test/acc (max)\n\n"
        "Tied on val/acc (0.920 ± 0.020): none (λ = 0), double_backprop λ = 0.1; none is "
        "chosen.\n\n"
        "| penalty | λ | seeds | val/acc | test/acc | Δ vs baseline (95% CI) |\n"
        "|---|---|---|---|---|---|\n"
        "| none | 0 | 3/3 | 0.920 ± 0.020 | 0.920 ± 0.020 |  |\n"
        "| double_backprop | 0.1 | 3/3 | 0.920 ± 0.020 | 0.920 ± 0.026 | +0.000 ± 0.043 |\n"
        "| double_backprop | 1 | 3/4 | 0.820 ± 0.017 | 0.820 ± 0.017 | -0.100 ± 0.025 |\n\n"
        "## test/acc_pgd (max)\n\n"
        "Chosen on val/acc_pgd: double_backprop λ = 1. On test/acc_pgd: against no penalty "
        "+0.15 (95% CI +0.04 to +0.26, 3 seeds), better beyond the noise; against the "
        "runner-up on validation, double_backprop λ = 0.1, +0.030 (95% CI -0.036 to +0.096, "
        "3 seeds), within the noise.\n\n"
        "| penalty | λ | seeds | val/acc_pgd | test/acc_pgd | Δ vs baseline (95% CI) |\n"
        "|---|---|---|---|---|---|\n"
        "| none | 0 | 3/3 | 0.500 ± 0.020 | 0.500 ± 0.020 |  |\n"
        "| double_backprop | 0.1 | 3/3 | 0.620 ± 0.020 | 0.620 ± 0.020 | +0.120 ± 0.050 |\n"
        "| double_backprop | 1 | 3/4 | **0.640 ± 0.020** | **0.650 ± 0.036** | "
        "**+0.15 ± 0.11** |\n")
    assert not list(tmp_path.rglob("events.out.tfevents.*"))  # no TensorBoard logs: no run


def test_the_optimized_metric_comes_first_and_a_sweep_without_baseline_marks_nothing(
        tmp_path: Path) -> None:
    """Without penalty=none jobs there is no difference to judge a best by; the optimized
    validation metric puts its test counterpart first."""
    synthetic_sweep(tmp_path)
    for job in tmp_path.glob("*_none_*"):
        for path in sorted(job.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        job.rmdir()
    run_summary(tmp_path, optimized="val/acc_pgd")
    summary = (tmp_path / "summary.md").read_text()
    assert "Seeds 0, 1, 2, 3; no penalty=none runs: no differences.\n" in summary
    assert [line for line in summary.splitlines() if line.startswith("## ")] == [
        "## test/acc_pgd (max)", "## test/acc (max)"]
    assert "**" not in summary
    assert "| double_backprop | 0.1 | 3/3 | 0.620 ± 0.020 | 0.620 ± 0.020 |  |" in summary
    assert ("Chosen on val/acc_pgd: double_backprop λ = 1. On test/acc_pgd: against the "
            "runner-up on validation, double_backprop λ = 0.1, +0.030 (95% CI -0.036 to "
            "+0.096, 3 seeds), within the noise.") in summary


def test_a_metric_without_a_validation_counterpart_chooses_nothing() -> None:
    """test/input_grad_norm logged without val/input_grad_norm: choosing on it would select on
    the test set."""
    jobs = [sweep_results.Job(penalty, weight, str(seed), {"seed": str(seed)},
                              {"test/input_grad_norm": value})
            for penalty, weight, seed, value in [("none", 0.0, 0, 0.9), ("none", 0.0, 1, 0.8),
                                                  ("r1", 1.0, 0, 0.5), ("r1", 1.0, 1, 0.4)]]
    summary = sweep_table.summary_markdown(jobs)
    assert ("No validation counterpart of test/input_grad_norm was logged: no setting is chosen"
            in summary)
    assert "**" not in summary
    # d = -0.4, -0.4: SD 0, the interval is 0 wide and excludes 0, but nothing was chosen
    assert "| r1 | 1 | 2/2 | 0.450 ± 0.071 | -0.4 ± 0 |" in summary


def test_the_figure_draws_each_metric_against_the_weight_on_a_log_axis(tmp_path: Path) -> None:
    """One panel per test metric, λ on a log axis: the penalty's line through its means at
    λ = 0.1 and 1 with a band of ± SD, the baseline's mean as a horizontal line; one legend."""
    synthetic_sweep(tmp_path)
    run_summary(tmp_path)
    assert (tmp_path / "metric_vs_weight.png").stat().st_size > 10_000
    figure = metric_vs_weight_figure(read_jobs(tmp_path))
    panels = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["test/acc", "test/acc_pgd"]
    for ax, values, sd in ((panels[0], ACC, 0.02), (panels[1], ACC_PGD, 0.02)):
        assert ax.get_xscale() == "log" and ax.get_xlabel() == "penalty weight λ"
        assert [tick.get_text() for tick in ax.get_xticklabels()] == ["0.1", "1"]
        baseline, line = ax.get_lines()
        assert baseline.get_label() == "none (λ = 0)"
        assert baseline.get_ydata()[0] == pytest.approx(statistics.fmean(
            values["none", seed] for seed in range(3)))
        assert line.get_label() == "double_backprop"
        assert list(line.get_xdata()) == [0.1, 1.0]
        assert list(line.get_ydata()) == pytest.approx([
            statistics.fmean(values[weight, seed] for seed in range(3))
            for weight in ("0.1", "1")])
        band = ax.collections[-1].get_paths()[0].vertices  # the penalty's ± SD band
        low = line.get_ydata()[0] - statistics.stdev(values["0.1", seed] for seed in range(3))
        assert band[:, 1].min() == pytest.approx(min(low, line.get_ydata()[1] - statistics.stdev(
            values["1", seed] for seed in range(3))))
        assert sd > 0
    assert [text.get_text() for text in figure.legends[0].get_texts()] == [
        "none (λ = 0)", "double_backprop"]


def test_the_figures_title_says_which_setting_was_chosen(tmp_path: Path) -> None:
    """Optimizing val/acc_pgd, the figure's first title line is the choice of its test
    counterpart (hand-computed in the summary's test above); on test/acc first, validation ties
    (0.920 both as shown): no choice, no line."""
    synthetic_sweep(tmp_path)
    figure = metric_vs_weight_figure(read_jobs(tmp_path), "val/acc_pgd", title="sweep x",
                                     direction="maximize")
    assert figure._suptitle.get_text().splitlines() == [
        "double_backprop λ = 1 chosen on val/acc_pgd; test/acc_pgd +0.15 (95% CI +0.04 to "
        "+0.26, 3 seeds) over no penalty", "sweep x",
        "mean ± SD over 4 seeds; grey dashed: no penalty"]
    untied = metric_vs_weight_figure(read_jobs(tmp_path), title="sweep x")
    assert untied._suptitle.get_text().splitlines()[0] == "sweep x"


def test_a_sweep_of_baselines_only_draws_no_figure(tmp_path: Path) -> None:
    synthetic_sweep(tmp_path)
    jobs = [job for job in read_jobs(tmp_path) if job.penalty == "none"]
    assert metric_vs_weight_figure(jobs) is None
    assert sweep_table.better("val/energy_distance") == "min"
    assert sweep_table.better("test/modes") == "max"
    assert sweep_table.better("test/wasserstein") is None
    assert sweep_table.better("test/wasserstein", "test/wasserstein", "maximize") == "max"


#: (penalty, λ, seed) -> the val/acc_pgd a job logged at steps 9 and 19 (0.97 and 0.05: values
#: that TensorBoard's "ignore outliers" scaling would leave outside its chart)
CURVES = {("none", 0.0, "0"): (0.40, 0.45), ("none", 0.0, "1"): (0.42, 0.48),
          ("double_backprop", 0.1, "0"): (0.50, 0.60), ("double_backprop", 0.1, "1"): (0.52, 0.97),
          ("double_backprop", 1.0, "0"): (0.30, 0.05)}


def curve_job(folder: Path, penalty: str, weight: float, overrides: dict[str, str],
              values: tuple[float, float]) -> sweep_results.Job:
    """A finished job whose event files hold ``values`` of val/acc_pgd at steps 9 and 19."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step, value in zip((9, 19), values, strict=True):
        writer.add_scalar("val/acc_pgd", value, step)
    writer.close()
    return sweep_results.Job(penalty, weight, overrides.get("seed", "0"), overrides,
                             {"val/acc_pgd": values[1], "test/acc_pgd": 0.5}, folder)


def test_the_validation_curves_draw_every_run_by_its_lambda_within_the_axes(
        tmp_path: Path) -> None:
    """Each job's logged val/acc_pgd as written to its event files, one colour per setting (the
    seeds of a setting alike), the legend naming each setting by its λ, and a vertical axis
    holding every value: 6% of their range (0.05 to 0.97) around them."""
    from gradreg.app.sweeps.curves import validation_curves_figure

    jobs = [curve_job(tmp_path / f"{k:03d}", penalty, weight, {"seed": seed}, values)
            for k, ((penalty, weight, seed), values) in enumerate(CURVES.items())]
    jobs.append(sweep_results.Job("double_backprop", 1.0, "1", {"seed": "1"}, None,
                                  tmp_path / "no_events"))  # failed: nothing drawn
    figure = validation_curves_figure(jobs, "val/acc_pgd", title="sweep x")
    (ax,) = [ax for ax in figure.axes if ax.get_visible()]
    assert ax.get_title() == "val/acc_pgd" and ax.get_xlabel() == "training step"
    curves = [line for line in ax.get_lines() if line.get_linestyle() != "None"]
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in curves] == [
        ([9, 19], pytest.approx(list(values))) for values in CURVES.values()]
    colours = [line.get_color() for line in curves]
    assert colours[0] == colours[1] and colours[2] == colours[3]
    assert len({str(colour) for colour in (colours[0], colours[2], colours[4])}) == 3
    assert [line.get_linestyle() for line in curves] == ["--", "--", "-", "-", "-"]
    dots = [line for line in ax.get_lines() if line.get_linestyle() == "None"]
    assert [float(dot.get_ydata()[0]) for dot in dots] == pytest.approx(
        [values[1] for values in CURVES.values()])
    assert ax.get_ylim() == pytest.approx((0.05 - 0.06 * 0.92, 0.97 + 0.06 * 0.92), rel=1e-6)
    assert [text.get_text() for text in figure.legends[0].get_texts()] == [
        "none (λ = 0)", "double_backprop λ = 0.1", "double_backprop λ = 1"]
    assert figure._suptitle.get_text().splitlines()[1] == "sweep x"
    # no event files: nothing to draw
    assert validation_curves_figure([sweep_results.Job("none", 0.0, "0", {}, {"val/acc": 1.0},
                                                       tmp_path / "no_events")]) is None


def test_the_validation_curves_of_a_search_colour_each_run_by_its_lambda_on_a_colour_bar(
        tmp_path: Path) -> None:
    """A search of 12 trials (each its own λ and lr, more than a legend names): each run's
    colour is the colour map's at its λ on a log scale from the smallest λ to the largest, one
    colour bar says so, and the legend names only the baseline."""
    from matplotlib.colors import LogNorm, to_rgba

    from gradreg.app.sweeps.curves import colour_map, validation_curves_figure

    weights = [0.001 * 2**k for k in range(12)]
    jobs = [curve_job(tmp_path / f"{k:03d}", "double_backprop", weight,
                      {"seed": "0", "model.optimizer.lr": f"{0.001 + k * 1e-4:.4g}"},
                      (0.3, 0.4 + 0.01 * k)) for k, weight in enumerate(weights)]
    jobs.append(curve_job(tmp_path / "baseline", "none", 0.0,
                          {"seed": "0", "model.optimizer.lr": "0.001"}, (0.3, 0.35)))
    figure = validation_curves_figure(jobs, "val/acc_pgd")
    ax = figure.axes[0]
    curves = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
    scale = LogNorm(weights[0], weights[-1])
    assert [to_rgba(line.get_color()) for line in curves] == [
        to_rgba(colour_map()(scale(weight))) for weight in weights]
    (bar,) = [axes for axes in figure.axes if axes.get_ylabel() == "penalty weight λ (log scale)"]
    assert bar.get_ylim() == pytest.approx((weights[0], weights[-1]))
    assert [text.get_text() for text in figure.legends[0].get_texts()] == [
        "none (λ = 0) model.optimizer.lr=0.001"]
    assert figure._suptitle.get_text().startswith(
        "validation metrics over training, every run: coloured by λ")


def test_a_grid_sweep_runs_the_baseline_once_and_writes_its_summary_figure_and_hparams(
        tmp_path: Path) -> None:
    """``-m penalty=none,double_backprop penalty.weight=0.3,1 callbacks=hparams``: three jobs,
    not four (penalty=none ignores the weight: one baseline job), named by their zero-padded
    number, penalty and weight; the baseline's HParams row has weight 0 (not the 0.3 it
    ignores), one ``weight`` column for every penalty and its log10; the TensorBoard runs are
    the three jobs and ``summary`` (figure, text and the one HParams declaration), no run
    ``.``; summary.md, of one seed, gives each Δ without an interval and says that no spread
    is known."""
    result = run_script("-m", "penalty=none,double_backprop", "penalty.weight=0.3,1",
                        *TRIAL, "callbacks=hparams", f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Launching 3 jobs locally" in result.stdout + result.stderr
    runs = trials(tmp_path)
    assert [folder.name for folder in runs] == [
        "000_none", "001_double_backprop:0.3", "002_double_backprop:1"]
    rows = {folder.name: hparams(folder) for folder in runs}
    assert [(row["penalty"], row["weight"], row.get("weight_log10"), row["lr_log10"])
            for row in rows.values()] == [
        ("none", 0.0, None, -3.0),
        ("double_backprop", 0.3, pytest.approx(math.log10(0.3)), -3.0),
        ("double_backprop", 1.0, 0.0, -3.0)]
    assert not any(name.startswith("penalty/weight/") for row in rows.values() for name in row)
    assert not list(tmp_path.glob("events.out.tfevents.*"))  # no run "."
    summary_run = EventAccumulator(str(tmp_path / "summary")).Reload()
    assert summary_run.Tags()["images"] == ["Sweep/metric_vs_weight", "Sweep/validation_curves"]
    content = summary_run.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/experiment"]).experiment
    # the columns that differ, each with a value in every run: not weight_log10 (blank for
    # penalty=none: the parallel coordinates would leave the baseline out), nor constant ones
    assert [(info.name, info.differs) for info in experiment.hparam_infos] == [
        ("penalty", True), ("weight", True)]
    assert (tmp_path / "metric_vs_weight.png").is_file()
    summary = (tmp_path / "summary.md").read_text()
    assert "Seeds 0; baseline: penalty=none (λ = 0). One seed: no spread is known" in summary
    metrics = [value for _, value in runs.values()]
    row = next(line for line in summary.split("## test/acc_pgd")[1].splitlines()
               if line.startswith("| double_backprop | 0.3 | 1/1 |"))
    delta = metrics[1]["test/acc_pgd"] - metrics[0]["test/acc_pgd"]
    assert row.split(" | ")[-1].strip(" |") == f"{delta:+.4g}"
    assert row.split(" | ")[-2] == f"{metrics[1]['test/acc_pgd']:.4g}"
    assert "With one seed no spread is known" in summary.split("## test/acc_pgd")[1]
    assert f"sweep summary ({tmp_path / 'summary.md'}):" in result.stdout


def test_the_grid_sweeper_drops_the_baseline_jobs_that_repeat_another() -> None:
    """Hydra's product of penalty=none,double_backprop, two weights and two seeds is 8 jobs;
    none ignores penalty.* keys, so 6 remain, each baseline once per seed and in Hydra's order;
    a batch size splits the 6."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.gradreg_sweepers.grid import GridSweeper

    overrides = OverridesParser.create().parse_overrides(
        ["penalty=none,double_backprop", "penalty.weight=0.1,1", "+penalty.every=1,2",
         "seed=0,1", "trainer.max_epochs=1"])
    (jobs,) = GridSweeper.split_arguments(overrides, None)
    assert [" ".join(job[:4]) for job in jobs] == [
        "penalty=none penalty.weight=0.1 +penalty.every=1 seed=0",
        "penalty=none penalty.weight=0.1 +penalty.every=1 seed=1",
        *(f"penalty=double_backprop penalty.weight={w} +penalty.every={e} seed={s}"
          for w in ("0.1", "1") for e in (1, 2) for s in (0, 1))]
    assert all(job[4] == "trainer.max_epochs=1" for job in jobs)
    assert [len(batch) for batch in GridSweeper.split_arguments(overrides, 4)] == [4, 4, 2]


def test_a_gan_sweep_bolds_nothing_that_two_seeds_cannot_tell_from_noise() -> None:
    """Energy distance (smaller is better), seeds 0 and 1, validation equal to test: R1 λ=1 is
    chosen (0.02, 0.03); against the baseline (0.05, 0.07) d = -0.03, -0.04: Δ = -0.035,
    SE = 0.005, but with 2 seeds h = t(0.975, 1)·SE = 12.706·0.005 = 0.063531: the interval
    -0.099 to +0.029 holds 0, no bold (|Δ| > 2·SE would have bolded it). The baseline (0.060)
    is the runner-up. λ=10: d = -0.01, +0.02, Δ = 0.005 (0.00499... in floats), SE = 0.015,
    h = 0.19. Modes (larger is better): λ=10 chosen (8 and 8), against the baseline (6 and 8)
    Δ = +1, SE = 1, h = 12.706: within the noise; the runner-up is the baseline (its 7.0 ties
    λ=1's and comes first in the table)."""
    values = {("none", 0.0): [(0.05, 6), (0.07, 8)], ("r1", 1.0): [(0.02, 7), (0.03, 7)],
              ("r1", 10.0): [(0.04, 8), (0.09, 8)]}
    jobs = [sweep_results.Job(penalty, weight, str(seed), {"seed": str(seed)},
                              {"test/energy_distance": distance, "test/modes": modes,
                               "val/energy_distance": distance, "val/modes": modes})
            for (penalty, weight), seeds in values.items()
            for seed, (distance, modes) in enumerate(seeds)]
    summary = sweep_table.summary_markdown(jobs)
    assert summary.endswith(
        "## test/energy_distance (min)\n\n"
        "Chosen on val/energy_distance: r1 λ = 1. On test/energy_distance: against no penalty "
        "-0.035 (95% CI -0.099 to +0.029, 2 seeds), within the noise; against the runner-up on "
        "validation, none (λ = 0), -0.035 (95% CI -0.099 to +0.029, 2 seeds), within the "
        "noise.\n\n"
        "| penalty | λ | seeds | val/energy_distance | test/energy_distance | "
        "Δ vs baseline (95% CI) |\n"
        "|---|---|---|---|---|---|\n"
        "| none | 0 | 2/2 | 0.060 ± 0.014 | 0.060 ± 0.014 |  |\n"
        "| r1 | 1 | 2/2 | 0.0250 ± 0.0071 | 0.0250 ± 0.0071 | -0.035 ± 0.064 |\n"
        "| r1 | 10 | 2/2 | 0.065 ± 0.035 | 0.065 ± 0.035 | +0.00 ± 0.19 |\n\n"
        "## test/modes (max)\n\n"
        "Chosen on val/modes: r1 λ = 10. On test/modes: against no penalty +1 (95% CI -12 to "
        "+14, 2 seeds), within the noise; against the runner-up on validation, none (λ = 0), "
        "+1 (95% CI -12 to +14, 2 seeds), within the noise.\n\n"
        "| penalty | λ | seeds | val/modes | test/modes | Δ vs baseline (95% CI) |\n"
        "|---|---|---|---|---|---|\n"
        "| none | 0 | 2/2 | 7.0 ± 1.4 | 7.0 ± 1.4 |  |\n"
        "| r1 | 1 | 2/2 | 7 ± 0 | 7 ± 0 | +0 ± 13 |\n"
        "| r1 | 10 | 2/2 | 8 ± 0 | 8 ± 0 | +1 ± 13 |\n")


def test_one_seed_names_the_choice_and_says_no_spread_is_known() -> None:
    """A search: every trial one seed. The best validation value chooses (λ=0.3: 0.7); its
    test differences are plain numbers, 0.65 - 0.5 = +0.15 and 0.65 - 0.6 = +0.05."""
    jobs = [sweep_results.Job(penalty, weight, "0", {"seed": "0"},
                              {"val/acc_pgd": val, "test/acc_pgd": test})
            for penalty, weight, val, test in [("none", 0.0, 0.5, 0.5),
                                               ("double_backprop", 0.1, 0.6, 0.6),
                                               ("double_backprop", 0.3, 0.7, 0.65)]]
    summary = sweep_table.summary_markdown(jobs, "val/acc_pgd", "maximize")
    assert "Seeds 0; baseline: penalty=none (λ = 0). One seed: no spread is known" in summary
    assert ("Chosen on val/acc_pgd: double_backprop λ = 0.3. On test/acc_pgd: against no "
            "penalty +0.15 (1 seed: no spread known), not told from noise; against the runner-up "
            "on validation, double_backprop λ = 0.1, +0.05 (1 seed: no spread known), not told "
            "from noise. With one seed no spread is known: no difference can be told from the "
            "noise (run seed=0,1,2).") in summary
    assert "**" not in summary
    assert "| double_backprop | 0.3 | 1/1 | 0.7 | 0.65 | +0.15 |" in summary


def test_a_search_draws_its_trials_as_points_of_one_colour_per_penalty() -> None:
    """An Optuna study: every trial its own λ and lr, one seed; no line joins trials of
    different learning rates, and the legend has one entry, the penalty."""
    trials_ = [(0.01, "0.001", 0.5), (1.0, "0.003", 0.7), (0.1, "0.0005", 0.6)]
    jobs = [sweep_results.Job("double_backprop", weight, "0",
                              {"seed": "0", "model.optimizer.lr": lr}, {"val/acc_pgd": value})
            for weight, lr, value in trials_]
    figure = metric_vs_weight_figure(jobs, optimized="val/acc_pgd")
    (ax,) = [ax for ax in figure.axes if ax.get_visible()]
    assert ax.get_title() == "val/acc_pgd" and ax.get_xscale() == "log"
    (points,) = ax.get_lines()
    assert points.get_linestyle() == "None"
    assert sorted(zip(points.get_xdata(), points.get_ydata(), strict=True)) == [
        (0.01, 0.5), (0.1, 0.6), (1.0, 0.7)]
    assert [text.get_text() for text in figure.legends[0].get_texts()] == ["double_backprop"]


def test_the_search_space_reads_hydras_sweep_syntax_and_the_command_line_wins() -> None:
    """The recipe's λ on a log scale is replaced by the command line's; a choice and a range are
    categories of their values; an integer interval; a plain value goes to every trial."""
    optuna = pytest.importorskip("optuna")
    from gradreg.app.checks.errors import ConfigError
    from gradreg.app.sweeps.search import search_space

    space = search_space(
        {"penalty.weight": "tag(log, interval(0.001, 10.0))",
         "model.optimizer.lr": "choice(0.001,0.01)"},
        ["penalty.weight=tag(log, interval(0.01, 3))", "seed=range(0,3)",
         "data.batch_size=tag(int, interval(16, 64))", "trainer.max_epochs=2"])
    distributions = optuna.distributions
    assert space.distributions == {
        "penalty.weight": distributions.FloatDistribution(0.01, 3.0, log=True),
        "model.optimizer.lr": distributions.CategoricalDistribution([0.001, 0.01]),
        "seed": distributions.CategoricalDistribution([0, 1, 2]),
        "data.batch_size": distributions.IntDistribution(16, 64)}
    assert space.fixed == ["trainer.max_epochs=2"]
    with pytest.raises(ConfigError, match="the search has no space to search"):
        search_space({}, ["trainer.max_epochs=2"])


def test_resuming_a_study_retries_the_trial_left_running_and_keeps_the_ended_ones() -> None:
    """Trial 0 complete, 1 pruned, 2 left running (its search killed): resume records 2 as
    failed, queues its parameters again, and counts 2 trials ended (not the one tried again,
    however often the search is resumed); run_trials then runs the queued one (trial 3, the
    parameters of 2) and one new, to 4 counted trials."""
    optuna = pytest.importorskip("optuna")
    from hydra.core.utils import JobReturn, JobStatus

    from gradreg.app.sweeps.search import Space, resume, run_trials

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    space = Space({"penalty.weight": optuna.distributions.FloatDistribution(0.01, 1.0)}, [])
    first, second, third = (study.ask(space.distributions) for _ in range(3))
    study.tell(first, 0.5)
    study.tell(second, state=optuna.trial.TrialState.PRUNED)
    assert resume(study) == (2, 1)
    states = optuna.trial.TrialState
    assert [t.state for t in study.trials] == [states.COMPLETE, states.PRUNED, states.FAIL,
                                               states.WAITING]
    launched = []

    def launch(jobs: list[list[str]], first_number: int) -> list[JobReturn]:
        launched.append((jobs, first_number))
        result = JobReturn()
        result.status, result.return_value = JobStatus.COMPLETED, 0.25
        return [result for _ in jobs]

    run_trials(study, space, n_trials=4, n_jobs=1, launch=launch)
    assert [number for _, number in launched] == [3, 4]
    assert launched[0][0] == [[f"penalty.weight={third.params['penalty.weight']!r}"]]
    assert [t.state for t in study.trials] == [states.COMPLETE, states.PRUNED, states.FAIL,
                                               states.COMPLETE, states.COMPLETE]
    assert study.trials[3].params == third.params and study.trials[3].values == [0.25]
    assert resume(study) == (4, 0)  # resumed again: nothing to do
