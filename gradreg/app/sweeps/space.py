"""The keys a multirun varies, the environment its jobs inherit in processes of their own, and
the packages its command line selects.

The keys come from the command line's sweep overrides (``penalty=none,double_backprop``,
``seed=range(3)``) and the sweeper's search space (``hydra.sweeper.params``); they name each
job's folder (:mod:`gradreg.app.run_names`). Launchers that run each job in a process of its own
(``hydra/launcher=joblib``, ``submitit_local``, ``submitit_slurm``) unpickle the task function
there, which imports this package: from a checkout, the jobs get its root on their
``PYTHONPATH`` (an installed package needs nothing), and the command line's swept keys in
``GRADREG_SWEPT_KEYS`` (:func:`jobs_environment`).

The packages of the extras that a command line selects (the sweeps extra: Optuna for a search,
Hydra's joblib and submitit launchers; the trackers extra: MLflow, W&B) are checked to be
installed before Hydra looks for them or the run builds its logger (:func:`check_plugins`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException

from ..checks.errors import ConfigError
from ..hydra_compat import command_line_parser

#: the environment variable that hands the swept keys to jobs in other processes
SWEPT_KEYS_VARIABLE = "GRADREG_SWEPT_KEYS"
#: the folder that holds the gradreg package the app runs from
PACKAGE_ROOT = Path(__file__).resolve().parents[3]


def command_line_overrides(argv: list[str]) -> list[Override]:
    """The overrides of a command line, read with Hydra's own argument parser (flags such as
    ``--cfg job`` are not overrides); none where they do not parse (Hydra itself then says
    why)."""
    args, _ = command_line_parser().parse_known_args(argv[1:])
    try:
        return OverridesParser.create().parse_overrides(args.overrides)
    except OverrideParseException:
        return []


def command_line_sweeps(argv: list[str]) -> set[str]:
    """The keys a multirun command line sweeps (``penalty=none,double_backprop``,
    ``seed=range(3)``, ``experiment=glob(*)``, ``penalty.weight=interval(0.01,1)``)."""
    return {override.key_or_group for override in command_line_overrides(argv)
            if override.is_sweep_override()}


def swept_keys(argv: list[str]) -> set[str]:
    """The keys a sweep varies, as Hydra's ``override_dirname`` writes them: those its command
    line sweeps (from ``GRADREG_SWEPT_KEYS`` in a job of another process, from ``argv`` in the
    process that parsed it) and the sweeper's search space (``hydra.sweeper.params``)."""
    exported = os.environ.get(SWEPT_KEYS_VARIABLE)
    keys = set(exported.split(",")) - {""} if exported is not None else command_line_sweeps(argv)
    if HydraConfig.initialized():
        keys |= set(HydraConfig.get().sweeper.get("params") or {})
    return keys


@contextmanager
def jobs_environment(argv: list[str]) -> Iterator[None]:
    """While the app runs: the environment its jobs inherit in processes of their own (a
    checkout's root first on ``PYTHONPATH``, so that they import the same gradreg; the command
    line's swept keys); restored after."""
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", SWEPT_KEYS_VARIABLE)}
    if (PACKAGE_ROOT / "pyproject.toml").is_file():  # a checkout, not site-packages
        paths = [str(PACKAGE_ROOT)] + [p for p in [saved["PYTHONPATH"]] if p]
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    os.environ[SWEPT_KEYS_VARIABLE] = ",".join(sorted(command_line_sweeps(argv)))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


#: (config group, option prefix) -> the module that it needs and the extra that installs it
PLUGINS = {("hparams_search", ""): ("optuna", "sweeps"),
           ("hydra/sweeper", "penalty_search"): ("optuna", "sweeps"),
           ("hydra/launcher", "joblib"): ("hydra_plugins.hydra_joblib_launcher", "sweeps"),
           ("hydra/launcher", "submitit"): ("hydra_plugins.hydra_submitit_launcher", "sweeps"),
           ("logger", "mlflow"): ("mlflow", "trackers"),
           ("logger", "wandb"): ("wandb", "trackers")}


def plugin_installed(module: str) -> bool:
    """Whether ``module`` (``optuna``, a Hydra plugin's ``hydra_plugins.<name>``) is installed;
    False too where no Hydra plugin is (no ``hydra_plugins`` package to search in)."""
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def check_plugins(argv: list[str]) -> None:
    """Raise ConfigError where the command line selects a search, launcher or tracker whose
    package is not installed (Hydra would say "Could not find 'hydra/launcher/joblib'")."""
    for override in command_line_overrides(argv):
        value = override.value()
        values = [item for item in (value if isinstance(value, list) else [value])
                  if isinstance(item, str)]  # logger=[tensorboard,mlflow]: each
        for (group, prefix), (plugin, extra) in PLUGINS.items():
            for chosen in values:
                if (override.key_or_group == group and chosen.startswith(prefix)
                        and not plugin_installed(plugin)):
                    package = plugin.split(".")[-1].replace("_", "-")
                    needs = (f"Hydra's plugin {package}" if plugin.startswith("hydra_plugins")
                             else package)
                    raise ConfigError(
                        f"{group}={chosen} needs {needs}, of the {extra} extra: "
                        f"pip install -e '.[{extra}]'"
                    )
