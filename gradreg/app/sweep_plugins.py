"""The packages of the sweeps extra that a command line selects (Optuna for a search, Hydra's
joblib and submitit launchers), checked to be installed before Hydra looks for them."""

from __future__ import annotations

from importlib.util import find_spec

from .errors import ConfigError
from .sweep_space import command_line_overrides

#: (config group, option prefix) -> the module that it needs, all of the sweeps extra
PLUGINS = {("hparams_search", ""): "optuna",
           ("hydra/sweeper", "penalty_search"): "optuna",
           ("hydra/launcher", "joblib"): "hydra_plugins.hydra_joblib_launcher",
           ("hydra/launcher", "submitit"): "hydra_plugins.hydra_submitit_launcher"}


def plugin_installed(module: str) -> bool:
    """Whether ``module`` (``optuna``, a Hydra plugin's ``hydra_plugins.<name>``) is installed;
    False too where no Hydra plugin is (no ``hydra_plugins`` package to search in)."""
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def check_plugins(argv: list[str]) -> None:
    """Raise ConfigError where the command line selects a search or launcher whose package is
    not installed (Hydra would say "Could not find 'hydra/launcher/joblib'")."""
    for override in command_line_overrides(argv):
        value = override.value() if isinstance(override.value(), str) else ""
        for (group, prefix), plugin in PLUGINS.items():
            if (override.key_or_group == group and value.startswith(prefix)
                    and not plugin_installed(plugin)):
                package = plugin.split(".")[-1].replace("_", "-")
                needs = f"Hydra's plugin {package}" if plugin.startswith("hydra_plugins") else (
                    package)
                raise ConfigError(
                    f"{group}={value} needs {needs}, of the sweeps extra: "
                    "pip install -e '.[sweeps]'"
                )

