"""The packages of the extras that a command line selects (the sweeps extra: Optuna for a search,
Hydra's joblib and submitit launchers; the trackers extra: MLflow, W&B), checked to be installed
before Hydra looks for them or the run builds its logger."""

from __future__ import annotations

from importlib.util import find_spec

from .errors import ConfigError
from .sweep_space import command_line_overrides

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
