"""The Hydra plugins of the sweeps extra that a command line selects (Optuna's sweeper, the joblib
and submitit launchers), checked to be installed before Hydra looks for them."""

from __future__ import annotations

from importlib.util import find_spec

from .errors import ConfigError
from .sweep_space import command_line_overrides

#: (config group, option prefix) -> the plugin module that provides it, all of the sweeps extra
PLUGINS = {("hparams_search", ""): "hydra_plugins.hydra_optuna_sweeper",
           ("hydra/sweeper", "optuna"): "hydra_plugins.hydra_optuna_sweeper",
           ("hydra/launcher", "joblib"): "hydra_plugins.hydra_joblib_launcher",
           ("hydra/launcher", "submitit"): "hydra_plugins.hydra_submitit_launcher"}


def plugin_installed(module: str) -> bool:
    """Whether the Hydra plugin module ``module`` (``hydra_plugins.<name>``) is installed; False
    too where no Hydra plugin is (no ``hydra_plugins`` package to search in)."""
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def check_plugins(argv: list[str]) -> None:
    """Raise ConfigError where the command line selects a sweeper or launcher whose Hydra plugin
    is not installed (Hydra would say "Could not find 'hydra/sweeper/optuna'")."""
    for override in command_line_overrides(argv):
        value = override.value() if isinstance(override.value(), str) else ""
        for (group, prefix), plugin in PLUGINS.items():
            if (override.key_or_group == group and value.startswith(prefix)
                    and not plugin_installed(plugin)):
                package = plugin.split(".")[1].replace("_", "-")
                raise ConfigError(
                    f"{group}={value} needs Hydra's plugin {package}, of the sweeps extra: "
                    "pip install -e '.[sweeps]'"
                )

