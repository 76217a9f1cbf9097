"""The command line's overrides checked before Hydra runs them: those that would fail inside Hydra
(SLURM's launcher off a cluster) or do what the user did not mean (a quoted ``~`` in a folder
option)."""

from __future__ import annotations

import shutil
from collections.abc import Iterable

from hydra.core.override_parser.types import Override

from .errors import ConfigError

#: path options that Hydra and the app use as they are written: a ``~`` in them is a folder name
HOME_UNEXPANDED = ("hydra.run.dir", "hydra.sweep.dir", "paths.runs", "paths.sweeps",
                   "paths.output_dir", "paths.scorer")


def check_overrides(overrides: Iterable[Override]) -> None:
    """Raise ConfigError for a command line that would fail inside Hydra or do what the user
    did not mean: SLURM's launcher where this machine has no ``sbatch`` and ``srun`` (not a
    cluster's node: submitit fails with a traceback), or a quoted ``~`` in a folder option of
    :data:`HOME_UNEXPANDED` (the shell does not expand it inside quotes, and a folder named ``~``
    would be created in the working directory)."""
    missing = [command for command in ("sbatch", "srun") if shutil.which(command) is None]
    for override in overrides:
        value = override.value()
        if override.key_or_group == "hydra/launcher" and value == "submitit_slurm" and missing:
            raise ConfigError(
                f"hydra/launcher=submitit_slurm: {' and '.join(missing)} not found on this "
                "machine (this launcher submits jobs to a SLURM cluster from one of its nodes); "
                "here run the jobs with hydra/launcher=submitit_local or hydra/launcher=joblib, "
                "or without a launcher option"
            )
        if (override.key_or_group in HOME_UNEXPANDED and isinstance(value, str)
                and value.startswith("~")):
            raise ConfigError(
                f"{override.key_or_group}={value}: ~ is not expanded here (a folder named ~ would "
                f"be created in the working directory); write {override.key_or_group}="
                f"$HOME{value[1:]}, which the shell expands"
            )
