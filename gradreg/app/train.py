"""Train with gradient penalties: ``gradreg-train [group=option ...] [key=value ...]`` (or
``python scripts/train.py ...`` in a checkout).

Examples::

    gradreg-train                                   # digits MLP + double backprop
    gradreg-train model=cnn penalty=double_backprop penalty.weight=0.1
    gradreg-train experiment=gan_8gaussians_wgan_gp
    gradreg-train -m penalty=none,double_backprop   # a sweep, one run per value
    gradreg-train -m hparams_search=classifier_robustness   # Optuna: weight and lr
    gradreg-train --help                            # the groups and their options

Hydra composes ``configs/train.yaml`` (:data:`gradreg.app.invocation.CONFIGS`) with its groups
(data, model, penalty, trainer, logger, callbacks, experiment, hparams_search, debug);
:func:`gradreg.app.training.fit` builds the objects with ``hydra.utils.instantiate`` and hands
them to Lightning. The training logic lives in :mod:`gradreg.lightning`.

The penalties of a run are ``penalty`` (unless ``penalty=none``) plus the ``penalties`` dict,
passed to the model as ``name -> GradientPenalty``. The run returns the metric named by
``optimized_metric`` (None without one), the value a sweeper such as Optuna's optimizes
(:mod:`gradreg.app.sweeps.trials`).

Errors: a configuration that cannot be built or used (unknown preset, negative weight, a critic
penalty for a classifier, ``n_critic < 1``, ``seed=abc``, ``data.batch_size=0``, an output folder
that cannot be written, a checkpoint that is missing or truncated ...) ends the run before
training with exit status 2 and one line on stderr naming the config key and the valid values;
``HYDRA_FULL_ERROR=1`` shows the traceback instead (:mod:`gradreg.app.checks.errors`,
:mod:`gradreg.app.resume`). Errors Hydra meets before the run that are the user's to fix (an
unknown group option or key, an override or config file that does not parse, a run folder it
cannot create) end it the same way (:func:`gradreg.app.checks.hydra_errors.hydra_error`).
A :class:`~gradreg.GradientError` raised while training (a penalty method the model does not
admit, an op without double backward, a NaN penalty) ends the run the same way, status 2 and one
line; in an Optuna search a NaN or Inf penalty fails only its trial, and the study goes on.
A run refused before training leaves no run folder behind (:mod:`gradreg.app.checks.errors`).
A run stopped by ``SIGTERM`` (a cluster's preemption) or Ctrl-C (``SIGINT``) stops after the
current batch, saves ``checkpoints/last.ckpt``, prints the command that resumes it in one line
and exits with status 143 (SIGTERM) or 130 (SIGINT), which also stops a sweep; a second Ctrl-C
stops at once, and the line names the run's last checkpoint.
"""

from __future__ import annotations

import sys
import warnings

import hydra
from omegaconf import DictConfig

from gradreg import GradientError, NonFiniteError
from gradreg.app import (
    hydra_compat,
    run_names,  # noqa: F401 (its resolvers name the run folders)
)
from gradreg.app.checks.errors import ConfigError, exit_with
from gradreg.app.checks.hydra_errors import hydra_error
from gradreg.app.checks.values import check_overrides, check_values
from gradreg.app.console import say
from gradreg.app.invocation import CONFIGS
from gradreg.app.sweeps import grid, space, trials


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="train")
def main(cfg: DictConfig) -> float | None:
    """One run (or one job of a sweep) of the composed configuration ``cfg``: the value of
    ``optimized_metric`` for a sweeper, None without one."""
    try:
        trials.check_search_mode()
        check_values(cfg)
        from gradreg.app import training  # Lightning, imported only to train

        return trials.objective(training.fit(cfg), cfg.optimized_metric)
    except NonFiniteError as error:  # a diverged Optuna trial fails alone; else as below
        if not trials.fails_trial_only():
            exit_with(error)
        say(f"error: training diverged, this trial fails and the search goes on: {error}",
            sys.stderr)
        raise trials.DivergedTrial(str(error)) from None
    except (ConfigError, GradientError) as error:  # say what to do, in one line
        exit_with(error)


def report_hydra_error(error: BaseException) -> None:
    """End the run as :func:`~gradreg.app.checks.errors.exit_with` does for an error Hydra meets
    outside :func:`main` that is the user's to fix (an override or config file that does not
    parse, a run folder it cannot create, a SLURM launcher off a cluster); return for the others
    (Hydra reports them)."""
    config_error = hydra_error(error)
    if config_error is not None:
        exit_with(config_error)


def run() -> None:
    """The app on ``sys.argv``: the overrides and the sweep plugins checked first (one line and
    status 2 for a mistake), then Hydra's own command line (``--help``, ``-m``, ...)."""
    warnings.filterwarnings("ignore", grid.SCHEMA_WARNING, UserWarning)
    try:
        space.check_plugins(sys.argv)
        check_overrides(space.command_line_overrides(sys.argv))
    except ConfigError as error:
        exit_with(error)
    with space.jobs_environment(sys.argv), hydra_compat.reporting_errors(report_hydra_error):
        main()
