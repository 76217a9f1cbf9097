"""Measure the app's documented runs and the test tiers, and write the numbers the documentation
quotes.

``python scripts/measure_app.py`` runs every command of :data:`RUNS` (``python scripts/train.py
<overrides>``, one CPU thread each, ``--jobs`` at a time) and of :data:`TESTS` (``python -m
pytest ...``, after the runs, one at a time), records its wall time, its CPU time (user +
system, of the command and its children) and its results (a run's test metrics, a tier's counts
of passed and skipped tests) in ``docs/measured/app.json``, with the machine, the torch release
and the load average, and then
rewrites the blocks of :data:`PAGES` between ``<!-- measured:<table> -->``
and ``<!-- /measured:<table> -->`` from that file (:data:`TABLES`). ``--render`` rewrites the
blocks from the recorded file without running anything; ``--only NAME ...`` re-runs some runs
or tiers; ``--count-tests`` records the tiers' test counts by a collection, without running
them.

The documentation's numbers are what this script wrote: ``tests/test_measured_docs.py`` holds
each block equal to its rendering of the recorded file, and the recorded overrides equal to
:data:`RUNS` (a changed recipe is measured again before its numbers are shown).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the torch release of the runs: the one this Python imports (scripts/train.py runs in it)
TORCH = metadata.version("torch")
RECORD = ROOT / "docs" / "measured" / "app.json"
PAGES = (ROOT / "docs" / "install.md", ROOT / "docs" / "app.md", ROOT / "docs" / "benchmarks.md")

#: run name -> the overrides of ``python scripts/train.py`` (seed 0 unless they say otherwise)
RUNS: dict[str, list[str]] = {
    "default": [],
    "digits_double_backprop": ["experiment=digits_double_backprop"],
    "digits_double_backprop/none": ["experiment=digits_double_backprop", "penalty=none"],
    "digits_input_and_hidden": ["experiment=digits_input_and_hidden"],
    "digits_input_and_hidden/none": ["experiment=digits_input_and_hidden", "penalty=none",
                                     "penalties={}"],
    "moons_jacobian": ["experiment=moons_jacobian"],
    "moons_jacobian/none": ["experiment=moons_jacobian", "penalty=none"],
    "moons_jacobian/threads=2": ["experiment=moons_jacobian", "threads=2"],
    "gan_8gaussians_wgan_gp": ["experiment=gan_8gaussians_wgan_gp"],
    "gan_8gaussians_wgan_gp/weight=10": ["experiment=gan_8gaussians_wgan_gp",
                                         "penalty.weight=10"],
    "gan_8gaussians_wgan_gp/seed=1": ["experiment=gan_8gaussians_wgan_gp", "seed=1"],
    "gan_8gaussians_wgan_gp/seed=2": ["experiment=gan_8gaussians_wgan_gp", "seed=2"],
    "gan_25gaussians_r1": ["experiment=gan_25gaussians_r1"],
    "gan_swissroll_wgan_lp": ["experiment=gan_swissroll_wgan_lp"],
    "gan_digits_r1": ["experiment=gan_digits_r1"],
    "gan_digits_r1/none": ["experiment=gan_digits_r1", "penalty=none"],
    "gan_digits_r1/seed=1": ["experiment=gan_digits_r1", "seed=1"],
    "gan_digits_r1/seed=2": ["experiment=gan_digits_r1", "seed=2"],
    "gan_digits_approx_r1": ["experiment=gan_digits_approx_r1"],
    "gan_digits_approx_r1/seed=1": ["experiment=gan_digits_approx_r1", "seed=1"],
    "gan_digits_wgan_gp": ["experiment=gan_digits_wgan_gp"],
    "gan_digits_wgan_gp/none": ["experiment=gan_digits_wgan_gp", "penalty=none"],
    "gan_digits_r3gan": ["experiment=gan_digits_r3gan"],
    "gan_digits_r3gan/none": ["experiment=gan_digits_r3gan", "penalty=none", "~penalties.r2"],
    "gan_digits_vit_r1": ["experiment=gan_digits_vit_r1"],
    "gan_digits_vit_r1/approx_r1": ["experiment=gan_digits_vit_r1", "penalty=approx_r1",
                                    "penalty.weight=1", "penalty.every=16"],
    "gan_digits_vit_r1/none": ["experiment=gan_digits_vit_r1", "penalty=none"],
    "digits_vit_embedding_penalty": ["experiment=digits_vit_embedding_penalty"],
    "digits_vit_embedding_penalty/none": ["experiment=digits_vit_embedding_penalty",
                                          "penalty=none"],
}


#: sweep -> the overrides of ``python scripts/train.py -m`` (a grid: one job per combination;
#: a ``hparams_search`` recipe: an Optuna study, one job per trial)
SWEEPS: dict[str, list[str]] = {
    "digits_weights": ["penalty=none,double_backprop", "penalty.weight=0.03,0.1,0.3,1",
                       "seed=0,1,2", "callbacks=dashboards"],
    "classifier_robustness": ["hparams_search=classifier_robustness"],
    "gan_quality": ["hparams_search=gan_quality"],
    # the launchers: the same jobs in the sweep's process and in 2 joblib workers
    "weights": ["penalty.weight=0.03,0.1,0.3,1"],
    "weights/joblib": ["penalty.weight=0.03,0.1,0.3,1", "hydra/launcher=joblib",
                       "hydra.launcher.n_jobs=2"],
    "gan_quality_2": ["hparams_search=gan_quality", "hydra.sweeper.n_trials=2",
                      "hydra.sweeper.n_jobs=2"],
    "gan_quality_2/joblib": ["hparams_search=gan_quality", "hydra.sweeper.n_trials=2",
                             "hydra.sweeper.n_jobs=2", "hydra/launcher=joblib",
                             "hydra.launcher.n_jobs=2"],
}
#: the test of the documentation's numbers (left out of the tiers this script times)
MEASURED_TEST = "test_measured_docs.py"
#: test tier -> the arguments of ``python -m pytest`` (the README's test commands)
TESTS: dict[str, list[str]] = {
    "fast": ["-m", "not slow"],
    "slow": ["-m", "slow"],
}


# ---------------------------------------------------------------------------------------------
# Running


def machine() -> dict[str, object]:
    """The machine and software the runs were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor()) \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": TORCH, "date": datetime.date.today().isoformat()}


def timed(name: str, command: list[str]) -> tuple[dict[str, object], str]:
    """Run ``command`` (from the checkout, one OpenMP thread) to its end: its wall and CPU
    time, the load average around it, the torch release and the date; and its stdout. Raises
    where it fails."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        # CPU time of this one child: wait4's resource usage (the children's total mixes jobs)
        process = subprocess.Popen(command, cwd=ROOT, stdout=stdout, stderr=stderr,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        # reaped here: the Popen object must not reap this pid again (another job's, reused)
        process.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        output = stdout.read()
        if process.returncode != 0:
            raise RuntimeError(f"{name}: {' '.join(command)} failed:\n"
                               f"{(output + stderr.read())[-3000:]}")
    return {"wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "load": round((load + os.getloadavg()[0]) / 2, 1), "torch": TORCH,
            "date": datetime.date.today().isoformat()}, output


def app_command(*arguments: str) -> list[str]:
    """``python scripts/train.py <arguments>``, without the progress bar."""
    return [sys.executable, str(ROOT / "scripts" / "train.py"), *arguments,
            "trainer.enable_progress_bar=false"]


def folder_of(name: str, folder: Path) -> Path:
    """The output folder of the run or sweep ``name`` in ``folder``: a value Hydra parses."""
    return folder / name.replace("/", "__").replace("=", "-")


def measure(name: str, overrides: list[str], folder: Path) -> dict[str, object]:
    """Run ``python scripts/train.py <overrides>`` once (its own run folder, one thread unless
    the overrides set ``threads``): :func:`timed`'s numbers and its test metrics."""
    run_dir = folder_of(name, folder)
    threads = [] if any(o.startswith("threads=") for o in overrides) else ["threads=1"]
    result, _ = timed(name, app_command(*overrides, *threads, f"hydra.run.dir={run_dir}"))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {"overrides": overrides, **result,
            "metrics": {key: round(value, 6) for key, value in sorted(metrics.items())
                        if key.startswith("test/")}}


def measure_sweep(name: str, overrides: list[str], folder: Path) -> dict[str, object]:
    """Run the sweep ``python scripts/train.py -m <overrides>`` (one thread per job):
    :func:`timed`'s numbers for the whole sweep, and each job's overrides and validation and
    test metrics, in job order."""
    from gradreg.app.sweeps.results import job_results  # the app's reading of a sweep folder

    sweep_dir = folder_of(name, folder)
    result, _ = timed(name, app_command("-m", *overrides, "threads=1",
                                        f"hydra.sweep.dir={sweep_dir}"))
    jobs = [{"overrides": job, "metrics": {key: round(value, 6) for key, value in
                                           sorted((metrics or {}).items())
                                           if key.startswith(("val/", "test/"))}}
            for job, metrics in job_results(sweep_dir)]
    return {"overrides": overrides, **result, "jobs": jobs}


def measure_tests(name: str) -> dict[str, object]:
    """Run the test tier ``name`` (``python -m pytest <TESTS[name]>``): :func:`timed`'s numbers
    and the counts of passed and skipped tests."""
    # the test of the recorded numbers is left out: they are being measured
    result, output = timed(name, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  f"--ignore={ROOT / 'tests' / MEASURED_TEST}",
                                  *TESTS[name]])
    counts = {word: int(number) for number, word in
              re.findall(r"(\d+) (passed|skipped)", output.splitlines()[-1])}
    return {"arguments": TESTS[name], **result, "passed": counts.get("passed", 0),
            "skipped": counts.get("skipped", 0)}


def optional_test_packages() -> list[str]:
    """The packages of ``pytest.importorskip`` calls in tests/ that this environment has: a
    module that skips at import is not collected, so a tier's count depends on them."""
    names = {match for path in (ROOT / "tests").rglob("*.py")
             for match in re.findall(r"importorskip\(\s*[\"']([\w.]+)[\"']", path.read_text())}
    return sorted(name for name in names if importlib.util.find_spec(name) is not None)


def collect_tests(name: str) -> dict[str, object]:
    """The number of tests of the tier ``name`` that pytest collects now (``--collect-only``,
    nothing run; the test of the recorded numbers left out), the date, and the optional
    packages it was collected with (:func:`optional_test_packages`)."""
    output = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "no:cacheprovider", f"--ignore={ROOT / 'tests' / MEASURED_TEST}",
                             *TESTS[name]], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    count = re.search(r"^(\d+)(?:/\d+)? tests? collected", output, re.MULTILINE)
    if count is None:
        raise RuntimeError(f"pytest collected no test of the {name} tier:\n{output[-3000:]}")
    return {"count": int(count[1]), "date": datetime.date.today().isoformat(),
            "packages": optional_test_packages()}


def run_all(names: Iterable[str], jobs: int, record: dict) -> None:
    """Measure the runs ``names``, ``jobs`` at a time, each saved in ``record`` (and the
    recorded file) as it ends; raise at the end where some failed."""
    failed = []
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(measure, name, RUNS[name], Path(folder)): name for name in names}
        for future in as_completed(futures):
            name = futures[future]
            try:
                record.setdefault("runs", {})[name] = result = future.result()
            except Exception as error:  # the other runs go on; raised below
                failed.append(f"{name}: {error}")
                continue
            save(record)
            print(f"{name}: {result['wall_s']} s wall, {result['cpu_s']} s CPU, load "
                  f"{result['load']}", flush=True)
    if failed:
        raise RuntimeError("\n\n".join(failed))


def save(record: dict) -> None:
    """Write ``record`` to :data:`RECORD`, with the machine it was measured on."""
    record["machine"] = machine()
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------
# Rendering


def seconds(value: float) -> str:
    """``9.8 s``, ``74 s``, ``2.4 min``."""
    if value < 10:
        return f"{value:.1f} s"
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.1f} min"


def classifier(run: dict) -> str:
    m = run["metrics"]
    return (f"acc {m['test/acc']:.3f}, FGSM acc {m['test/acc_fgsm']:.3f}, PGD acc "
            f"{m['test/acc_pgd']:.3f}, input-gradient norm {m['test/input_grad_norm']:.2f}")


def toy_gan(run: dict) -> str:
    m = run["metrics"]
    modes = (f"{m['test/modes']:.0f} modes, {100 * m['test/high_quality']:.1f}% high "
             "quality, " if "test/modes" in m else "")
    return f"{modes}energy distance {m['test/energy_distance']:.4f}"


def image_gan(run: dict) -> str:
    m = run["metrics"]
    return (f"{m['test/modes']:.0f}/10 classes, KL {m['test/kl']:.3f}, feature ED "
            f"{m['test/feature_energy_distance']:.3f}, pixel ED "
            f"{m['test/energy_distance']:.3f}, critic gap {m['test/wasserstein']:.3g}")


def timing(run: dict) -> str:
    return f"{seconds(run['cpu_s'])} CPU, {seconds(run['wall_s'])} wall"


#: experiment -> (what it shows, how its metrics read, the baseline's run and what it is)
EXPERIMENTS: dict[str, tuple[str, Callable[[dict], str], str | None]] = {
    "digits_double_backprop": ("CNN, double backprop λ = 0.3, 20 epochs", classifier,
                               "digits_double_backprop/none"),
    "digits_input_and_hidden": ("MLP, double backprop on the inputs + `intermediate` on `act1`, "
                                "20 epochs", classifier, "digits_input_and_hidden/none"),
    "moons_jacobian": ("MLP, Jacobian penalty λ = 0.003, FGSM ε = 0.3", classifier,
                       "moons_jacobian/none"),
    "gan_8gaussians_wgan_gp": ("WGAN-GP, n_critic = 5, λ = 0.1, 800 generator steps; baseline "
                               "λ = 10", toy_gan, "gan_8gaussians_wgan_gp/weight=10"),
    "gan_25gaussians_r1": ("non-saturating GAN, lazy R1 (γ = 0.1, every 16), 4,000 generator "
                           "steps", toy_gan, None),
    "gan_swissroll_wgan_lp": ("WGAN-LP (λ = 0.1) on the critic + path length on the generator",
                              toy_gan, None),
    "gan_digits_r1": ("DCGAN 16x16, non-saturating loss, lazy R1 (γ = 1, every 16), 2,000 "
                      "generator steps", image_gan, "gan_digits_r1/none"),
    "gan_digits_approx_r1": ("`gan_digits_r1` with `penalty=approx_r1` (R1 without a double "
                             "backward, same γ); baseline: exact R1", image_gan, "gan_digits_r1"),
    "gan_digits_wgan_gp": ("DCGAN 16x16, WGAN-GP (λ = 10, n_critic = 5), 800 generator steps",
                           image_gan, "gan_digits_wgan_gp/none"),
    "gan_digits_r3gan": ("DCGAN 16x16, relativistic pairing loss + R1 + R2 (γ = 1 each), 2,000 "
                         "generator steps; baseline: the relativistic loss alone", image_gan,
                         "gan_digits_r3gan/none"),
    "gan_digits_vit_r1": ("`gan_digits_r1` with a ViT critic (4x4 patches: 16 tokens, width 32, "
                          "2 layers, 4 heads), lazy exact R1 through its attention (γ = 1, every "
                          "16)", image_gan, "gan_digits_vit_r1/none"),
    "gan_digits_vit_r1/approx_r1": ("`gan_digits_vit_r1` with `penalty=approx_r1` (same γ, "
                                    "every 16)", image_gan, "gan_digits_vit_r1/none"),
    "digits_vit_embedding_penalty": ("transformer classifier (2x2 patches: 16 tokens, width 32, "
                                     "2 layers), double backprop on the token embeddings "
                                     "(`intermediate`, layer `embed`, λ = 0.1), 20 epochs",
                                     classifier, "digits_vit_embedding_penalty/none"),
}


def measured_on(record: dict, entry: dict | None = None) -> str:
    """``python scripts/measure_app.py`` on <date>: <cpu>, <cores> CPU cores, torch <release>;
    the date of ``entry`` (a run, sweep or tier measured on its own) where given."""
    m = record["machine"]
    date = (entry or {}).get("date", m["date"])
    return (f"`python scripts/measure_app.py` on {date}: {m['cpu']}, {m['cores']} CPU "
            f"cores, torch {m['torch']}")


def dates_of(entries: Iterable[dict]) -> dict[str, str]:
    """The date of runs or sweeps measured on one day, or the first and the last, as an entry
    for :func:`measured_on`."""
    dates = sorted({entry["date"] for entry in entries})
    return {"date": dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"}


def footer(record: dict, names: Iterable[str]) -> str:
    runs = [record["runs"][name] for name in names]
    loads = [run["load"] for run in runs]
    return (f"Measured by {measured_on(record, dates_of(runs))}, Python "
            f"{record['machine']['python']}, one "
            f"thread per run, load average {min(loads):g}-{max(loads):g} during the runs (CPU "
            "time is the comparable figure where the load is above 1). Seed 0 unless a row says "
            "otherwise; metrics on the test split.")


def experiments_table(record: dict) -> str:
    runs = record["runs"]
    rows = ["| experiment | what it shows | result | baseline | time |",
            "|---|---|---|---|---|"]
    used = []
    for name, (what, read, baseline) in EXPERIMENTS.items():
        base = runs[baseline] if baseline else None
        label = f"`{name}`" if "/" not in name else f"`{name.split('/')[0]}` ({name.split('/')[1]})"
        rows.append(f"| {label} | {what} | {read(runs[name])} | "
                    f"{read(base) if base else ''} | {timing(runs[name])}"
                    f"{f'; baseline {timing(base)}' if base else ''} |")
        used += [name] + ([baseline] if baseline else [])
    return "\n".join(rows) + "\n\n" + footer(record, used)


def digits_gan_seeds_table(record: dict) -> str:
    runs = record["runs"]
    names = ["gan_digits_r1", "gan_digits_approx_r1", "gan_digits_r1/seed=1",
             "gan_digits_approx_r1/seed=1"]
    rows = ["| recipe | seed | classes | KL | feature ED | pixel ED | CPU time | wall time |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        m, run = runs[name]["metrics"], runs[name]
        rows.append(f"| `{name.split('/')[0]}` | {1 if 'seed=1' in name else 0} | "
                    f"{m['test/modes']:.0f}/10 | {m['test/kl']:.3f} | "
                    f"{m['test/feature_energy_distance']:.3f} | "
                    f"{m['test/energy_distance']:.3f} | {seconds(run['cpu_s'])} | "
                    f"{seconds(run['wall_s'])} |")
    return "\n".join(rows) + "\n\n" + footer(record, names)


#: experiment -> its metrics read over seeds (label, metric, format)
SEEDED: dict[str, list[tuple[str, str, str]]] = {
    "gan_8gaussians_wgan_gp": [("high-quality share", "test/high_quality", ".3f"),
                               ("energy distance", "test/energy_distance", ".4f")],
    "gan_digits_r1": [("class-histogram KL", "test/kl", ".3f"),
                      ("feature ED", "test/feature_energy_distance", ".3f")],
}


def gan_seeds_table(record: dict) -> str:
    """Each of :data:`SEEDED`'s experiments over seeds 0, 1, 2: per metric the mean ± sample
    standard deviation, then the seeds' values."""
    runs = record["runs"]
    rows = ["| experiment | metric | mean ± SD over seeds 0, 1, 2 | seed 0 | seed 1 | seed 2 |",
            "|---|---|---|---:|---:|---:|"]
    names = []
    for experiment, metrics in SEEDED.items():
        seeds = [experiment, f"{experiment}/seed=1", f"{experiment}/seed=2"]
        names += seeds
        for label, key, spec in metrics:
            values = [runs[name]["metrics"][key] for name in seeds]
            digits = int(spec[1:-1])
            rows.append(f"| `{experiment}` | {label} | {mean_std(values, digits)} | "
                        + " | ".join(f"{value:{spec}}" for value in values) + " |")
    return "\n".join(rows) + "\n\n" + footer(record, names)


def default_run(record: dict) -> str:
    run = record["runs"]["default"]
    threads = record["runs"]["moons_jacobian/threads=2"]
    one = record["runs"]["moons_jacobian"]
    return (f"The default run, `python scripts/train.py` (the digits MLP with double backprop, "
            f"10 epochs): {seconds(run['wall_s'])} of wall time, {seconds(run['cpu_s'])} of CPU "
            f"time, test accuracy {run['metrics']['test/acc']:.3f}. `experiment=moons_jacobian` "
            f"took {seconds(one['wall_s'])} with one thread and {seconds(threads['wall_s'])} "
            f"with two (`threads=2`) while other work held the other core (load average "
            f"{threads['load']:g}); test accuracy {one['metrics']['test/acc']:.3f} and "
            f"{threads['metrics']['test/acc']:.3f}.\n\n"
            + footer(record, ["default", "moons_jacobian", "moons_jacobian/threads=2"]))


def about(count: int) -> str:
    """``count`` to two significant digits, with a thousands separator: ``about 1,500``."""
    return f"about {round(count, 1 - len(str(count)) + 1):,}"


def test_tiers(record: dict) -> str:
    fast, slow = record["tests"]["fast"], record["tests"]["slow"]
    timed_then = ("" if fast["date"] == fast["collected"]["date"] else
                  f" ({fast['passed'] + fast['skipped']:,} and "
                  f"{slow['passed'] + slow['skipped']:,} tests then)")
    return ("`python -m pytest -m \"not slow\"` runs the fast tier, "
            f"{about(fast['collected']['count'])} tests, and `python -m pytest -m slow` the slow "
            f"tier, {about(slow['collected']['count'])} (counts collected on "
            f"{fast['collected']['date']} with the optional packages "
            f"{', '.join(fast['collected']['packages'])}; tests/{MEASURED_TEST} compares them "
            f"with a collection of the checkout where the same are installed). Timed by "
            f"{measured_on(record, fast)}{timed_then}, the fast tier "
            f"took {seconds(fast['cpu_s'])} of CPU time ({seconds(fast['wall_s'])} of wall time, "
            f"load average {fast['load']:g}) and the slow tier {seconds(slow['cpu_s'])} "
            f"({seconds(slow['wall_s'])} of wall time, load {slow['load']:g}; the app, DDP and "
            "FSDP processes it starts included).")


def mean_std(values: list[float], digits: int = 3) -> str:
    """``mean ± std`` (sample standard deviation, n - 1, as the sweep's summary.md) of
    ``values``."""
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def sweep_footer(record: dict, name: str, what: str) -> str:
    sweep = record["sweeps"][name]
    return (f"{what}: {seconds(sweep['wall_s'])} of wall time, {seconds(sweep['cpu_s'])} of CPU "
            f"time, one thread per job. Measured by {measured_on(record, sweep)}, load average "
            f"{sweep['load']:g}.")


def digits_weights_table(record: dict) -> str:
    jobs = record["sweeps"]["digits_weights"]["jobs"]
    columns = ("test/acc", "test/acc_fgsm", "test/acc_pgd", "test/input_grad_norm")
    groups: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
    for job in jobs:
        o = job["overrides"]
        key = (o["penalty"], "-" if o["penalty"] == "none" else o["penalty.weight"])
        seen = groups.setdefault(key, {}).setdefault(o["seed"], job["metrics"])
        if seen != job["metrics"]:
            raise ValueError(f"{key}, seed {o['seed']}: two runs of one setting differ")
    rows = ["| penalty | weight | test accuracy | under FGSM | under PGD-10 | "
            "mean ‖∇ₓ loss_i‖ (test) |", "|---|---|---|---|---|---|"]
    for (penalty, weight), seeds in groups.items():
        cells = [mean_std([metrics[c] for metrics in seeds.values()]) for c in columns]
        rows.append(f"| {penalty} | {weight} | {' | '.join(cells)} |")
    runs = sum(1 for job in jobs if job["overrides"]["penalty"] == "none")
    return ("\n".join(rows) + "\n\nMean ± sample standard deviation (n − 1) over seeds "
            f"{', '.join(sorted({job['overrides']['seed'] for job in jobs}))}; {runs} runs "
            "without a penalty, one per seed (penalty=none ignores the weight, so the sweep runs "
            "it once). " + sweep_footer(record, "digits_weights",
                                        f"The {len(jobs)} jobs, with `callbacks=dashboards`"))


def study_table(record: dict, name: str, lr: str, optimized: str, higher_is_better: bool,
                columns: dict[str, Callable[[dict], str]]) -> str:
    """The best four trials of an Optuna study and its worst: trial, λ, lr, ``columns``."""
    jobs = list(enumerate(record["sweeps"][name]["jobs"]))
    ranked = sorted((job for job in jobs if job[1]["metrics"]),
                    key=lambda job: job[1]["metrics"][optimized], reverse=higher_is_better)
    shown = [*ranked[:4], ranked[-1]]
    rows = ["| trial | λ | lr | " + " | ".join(columns) + " |",
            "|---|---|---|" + "---|" * len(columns)]
    for rank, (trial, job) in enumerate(shown):
        o, m = job["overrides"], job["metrics"]
        label = (f"{trial} (best)" if rank == 0 else
                 f"{trial} (worst)" if rank == len(shown) - 1 else str(trial))
        rows.append(f"| {label} | {float(o['penalty.weight']):.3g} | {float(o[lr]):.3g} | "
                    + " | ".join(cell(m) for cell in columns.values()) + " |")
    failed = sum(1 for _, job in jobs if not job["metrics"])
    return ("\n".join(rows) + f"\n\nThe four best trials by `{optimized}` and the worst"
            + (f" ({failed} trials stopped early: pruned or diverged)" if failed else "") + ". "
            + sweep_footer(record, name, f"The {len(jobs)} trials"))


def classifier_robustness_table(record: dict) -> str:
    return study_table(record, "classifier_robustness", "model.optimizer.lr", "val/acc_pgd", True, {
        "val acc under PGD": lambda m: f"{m['val/acc_pgd']:.3f}",
        "val acc": lambda m: f"{m['val/acc']:.3f}",
        "test acc": lambda m: f"{m['test/acc']:.3f}",
        "test acc under PGD": lambda m: f"{m['test/acc_pgd']:.3f}"})


def gan_quality_table(record: dict) -> str:
    return study_table(record, "gan_quality", "model.generator_optimizer.lr",
                       "val/energy_distance", False, {
                           "val energy distance": lambda m: f"{m['val/energy_distance']:.3g}",
                           "modes": lambda m: f"{m['test/modes']:.0f}",
                           "high-quality share": lambda m: f"{m['test/high_quality']:.3f}",
                           "test energy distance": lambda m: f"{m['test/energy_distance']:.3g}"})


def launchers(record: dict) -> str:
    sweeps = record["sweeps"]
    names = ("weights", "weights/joblib", "gan_quality_2", "gan_quality_2/joblib")
    load = max(sweeps[name]["load"] for name in names)
    joblib_gain = sweeps["weights"]["wall_s"] / sweeps["weights/joblib"]["wall_s"]
    return (f"Measured: two `gan_quality` trials (`hydra.sweeper.n_trials=2 "
            f"hydra.sweeper.n_jobs=2`) took {seconds(sweeps['gan_quality_2']['wall_s'])} one "
            f"after the other and {seconds(sweeps['gan_quality_2/joblib']['wall_s'])} with "
            "`hydra/launcher=joblib hydra.launcher.n_jobs=2`. Short jobs gain "
            f"{'nothing' if joblib_gain < 1.1 else 'less'}: the four "
            "10-epoch jobs of `penalty.weight=0.03,0.1,0.3,1` took "
            f"{seconds(sweeps['weights']['wall_s'])} in the sweep's process and "
            f"{seconds(sweeps['weights/joblib']['wall_s'])} with joblib, whose worker processes "
            "first import torch and Lightning. By "
            f"{measured_on(record, dates_of(sweeps[name] for name in names))}, load average up to "
            f"{load:g} (the wall time of 2 workers on 2 cores depends on what else runs).")


#: the blocks of the documentation and how each is rendered from the recorded file
TABLES: dict[str, Callable[[dict], str]] = {
    "default_run": default_run,
    "test_tiers": test_tiers,
    "digits_weights": digits_weights_table,
    "classifier_robustness": classifier_robustness_table,
    "gan_quality": gan_quality_table,
    "launchers": launchers,
    "experiments": experiments_table,
    "digits_gan_seeds": digits_gan_seeds_table,
    "gan_seeds": gan_seeds_table,
}

#: a measured block: its opening line, its text (empty or whole lines), its closing marker
BLOCK = re.compile(r"(<!-- measured:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /measured:"
                   r"(?P=name) -->)", re.DOTALL)


def blocks(text: str) -> dict[str, str]:
    """The measured blocks of a page: table name -> its text."""
    return {match["name"]: match["body"] for match in BLOCK.finditer(text)}


def render(text: str, record: dict) -> str:
    """``text`` with every measured block rendered from ``record``."""
    return BLOCK.sub(lambda m: m[1] + TABLES[m["name"]](record) + "\n" + m[4], text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted([*RUNS, *SWEEPS, *TESTS]),
                        metavar="NAME",
                        help="measure these runs or tiers only (the others keep their recorded "
                             "numbers)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument("--count-tests", action="store_true",
                        help="record the tiers' test counts by a collection (nothing run; "
                             "their times stay as recorded)")
    parser.add_argument("--render", action="store_true",
                        help="rewrite the documentation from the recorded numbers only")
    args = parser.parse_args()
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if args.count_tests:
        for name in TESTS:
            record["tests"][name]["collected"] = collect_tests(name)
        save(record)
    elif not args.render:
        chosen = args.only or [*RUNS, *SWEEPS, *TESTS]
        run_all([name for name in chosen if name in RUNS], args.jobs, record)
        for name in (name for name in chosen if name in SWEEPS):
            with tempfile.TemporaryDirectory() as folder:
                record.setdefault("sweeps", {})[name] = measure_sweep(name, SWEEPS[name],
                                                                      Path(folder))
            save(record)
            print(f"sweep {name}: {record['sweeps'][name]['wall_s']} s wall", flush=True)
        for name in (name for name in chosen if name in TESTS):
            record.setdefault("tests", {})[name] = {**measure_tests(name),
                                                    "collected": collect_tests(name)}
            save(record)
            print(f"tests {name}: {record['tests'][name]}", flush=True)
    for page in PAGES:
        page.write_text(render(page.read_text(), record))


if __name__ == "__main__":
    main()
