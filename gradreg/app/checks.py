"""What the app checks before it trains: values a run cannot use, a folder it cannot write, a
checkpoint it cannot load, callbacks made for another kind of model; and what it makes of the
errors Hydra meets before the run (an override or a config file that does not parse, a run
folder it cannot create, a launcher this machine cannot run). Each failure is a
:class:`ConfigError` whose message starts with the config key, so that :func:`exit_with` prints it
as one line and exits with status 2."""

from __future__ import annotations

import difflib
import math
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import yaml
from hydra.core.override_parser.types import Override
from hydra.errors import (
    ConfigCompositionException,
    InstantiationException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from .console import say
from .refused_run import discard_folder


class ConfigError(Exception):
    """A part of the configuration cannot be used; the message starts with its key."""


def exit_with(error: Exception) -> NoReturn:
    """End the run with status 2 and one line on stderr: the :class:`ConfigError`'s message,
    or ``training: <error>`` for an error met while training (``HYDRA_FULL_ERROR=1``: raise it,
    with its traceback). A refused run (a ConfigError) leaves no folder behind
    (:func:`~gradreg.app.refused_run.discard_folder`)."""
    refused = isinstance(error, ConfigError)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        if refused:
            discard_folder()
        raise error
    where = "" if refused else "training: "
    say(f"error: {where}{error}  (HYDRA_FULL_ERROR=1 shows the traceback)", sys.stderr)
    if refused:
        discard_folder()
    sys.exit(2)


@contextmanager
def building(key: str) -> Iterator[None]:
    """Turn any error raised while building ``key`` into a ConfigError naming ``key``."""
    try:
        yield
    except Exception as error:
        while _hydra_wrapper(error):  # report what the constructor or the import said
            error = error.__cause__
        raise ConfigError(f"{key}: {error or type(error).__name__}") from error


def _hydra_wrapper(error: BaseException) -> bool:
    """Whether ``error`` is Hydra's wrapper of another: an InstantiationException, or the
    ImportError ("Error loading '<_target_>'") of a target whose module failed to import."""
    if error.__cause__ is None:
        return False
    return isinstance(error, InstantiationException) or (
        isinstance(error, ImportError) and str(error).startswith("Error loading"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: the largest seed numpy accepts (Lightning seeds numpy with the run's seed)
MAX_SEED = 2**32 - 1


def _is_positive_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


#: key -> (test of the value, what the value must be); checked before anything is built.
VALUE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (lambda v: _is_int(v) and 0 <= v <= MAX_SEED,
             f"an integer from 0 to {MAX_SEED} (numpy's seed range)"),
    "threads": (lambda v: v is None or (_is_int(v) and v >= 1),
                "an integer >= 1 (the run's CPU threads, in every thread pool), or null for "
                "each library's default"),
    "trainer.max_epochs": (lambda v: v is None or (_is_int(v) and v >= 1),
                           "an integer >= 1 (0 would report the untrained model's metrics as "
                           "results; -1, training without end, is not offered: set "
                           "+trainer.max_steps=<N> instead)"),
    "trainer.max_steps": (lambda v: _is_int(v) and (v == -1 or v >= 1),
                          "an integer >= 1, or -1 for no step limit"),
    "data.batch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "trainer.accumulate_grad_batches": (lambda v: _is_int(v) and v >= 1,
                                        "an integer >= 1 (batches per optimizer step)"),
    "trainer.check_val_every_n_epoch": (lambda v: v is None or (_is_int(v) and v >= 1),
                                        "an integer >= 1, or null"),
    # torch scales the gradients by min(1, clip / norm): a negative clip reverses them
    "trainer.gradient_clip_val": (lambda v: v is None or v == 0 or _is_positive_number(v),
                                  "a finite number > 0, or null (0: no clipping)"),
    "data.num_workers": (lambda v: _is_int(v) and v >= 0,
                         "an integer >= 0 (0: batches are loaded in the training process)"),
}


def check_values(cfg: DictConfig) -> None:
    """Raise ConfigError for the first value of :data:`VALUE_RULES` that breaks its rule, for a
    learning rate that is not a finite number > 0 (``model.<any>optimizer.lr``: 0 trains
    nothing, a negative one ascends the loss), for a name given to two penalties, or for a
    callback made for another kind of model."""
    for key, (valid, requirement) in VALUE_RULES.items():
        section, _, name = key.rpartition(".")
        node = cfg.get(section) if section else cfg
        if node is None or name not in node:
            continue
        value = node[name]
        if not valid(value):
            raise ConfigError(f"{key}: must be {requirement}, got {value!r}")
    for name, node in (cfg.get("model") or {}).items():
        if (str(name).endswith("optimizer") and isinstance(node, DictConfig) and "lr" in node
                and not _is_positive_number(node.lr)):
            raise ConfigError(f"model.{name}.lr: must be a finite number > 0 (the optimizer's "
                              f"step size), got {node.lr!r}")
    _check_penalty_names(cfg)
    _check_callbacks(cfg)


def _check_penalty_names(cfg: DictConfig) -> None:
    """The model gets ``penalty`` under its preset name and each ``penalties`` entry under its
    key: one name for two penalties would keep one of them and drop the other."""
    main = cfg.penalty.get("name") if cfg.get("penalty") is not None else None
    if main not in (None, "none") and main in (cfg.get("penalties") or {}):
        raise ConfigError(
            f"penalties.{main}: {main} is already the name of penalty={main}, and the model "
            f"takes one penalty per name (one would replace the other); give this one another "
            f"name, e.g. +penalties.{main}_2=..., or set penalty=none"
        )


GAN_2D, GAN_IMAGES = "GAN on 2D points", "GAN on images"
#: callbacks made for some kinds of model: class -> (those kinds, how a message names them)
CALLBACK_KINDS: dict[str, tuple[set[str], str]] = {
    "SaliencyMaps": ({"Classifier"}, "a Classifier"),
    "InterpolatesGradientNorm": ({GAN_2D, GAN_IMAGES}, "a GAN"),
    "CriticLandscape": ({GAN_2D}, f"a {GAN_2D}"),
    "SampleGrid": ({GAN_IMAGES}, f"a {GAN_IMAGES}"),
}
#: the callbacks config made for each kind of model
DASHBOARDS = {"Classifier": "dashboards", GAN_2D: "gan_dashboards",
              GAN_IMAGES: "image_gan_dashboards"}


def _model_kind(cfg: DictConfig) -> str | None:
    """Classifier, GAN on 2D points or GAN on images (its data has ``shape``); None for a
    model class of the user's."""
    name = str(cfg.model.get("_target_", "")).rpartition(".")[2]
    if name == "GAN":
        shape = OmegaConf.select(cfg, "data.shape", throw_on_resolution_failure=False)
        return GAN_IMAGES if shape is not None else GAN_2D
    return name if name == "Classifier" else None


def _check_callbacks(cfg: DictConfig) -> None:
    """A dashboard callback made for another kind of model fails mid-training (a classifier
    has no critic; a 2D landscape of an image critic means nothing): refuse it up front."""
    kind = _model_kind(cfg)
    for name, node in (cfg.get("callbacks") or {}).items():
        target = str(node.get("_target_", "")) if isinstance(node, DictConfig) else ""
        kinds, described = CALLBACK_KINDS.get(target.rpartition(".")[2], (None, ""))
        if kind is not None and kinds is not None and kind not in kinds:
            raise ConfigError(
                f"callbacks: {target.rpartition('.')[2]} (callbacks.{name}) is for {described}, "
                f"but the model is a {kind}; use callbacks={DASHBOARDS[kind]} (or default, "
                "none)"
            )


def check_writable(output_dir: Path) -> None:
    """Raise ConfigError unless ``output_dir`` can be created and written (before training, so
    that a run's metrics and checkpoints are never lost at its end)."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as error:
        raise ConfigError(
            f"paths.output_dir: cannot write to {str(output_dir)!r} ({error.strerror or error}); "
            "choose a folder you can write: a new paths.output_dir=<folder>, or "
            "paths.runs=<folder> (a new folder under it for every run)"
        ) from error


def resolve_checkpoint(ckpt_path: str | None, runs_root: Path, output_dir: Path) -> Path | None:
    """The checkpoint file to resume from, checked to be a complete one.

    ``ckpt_path`` is a checkpoint file; or a run folder (its ``checkpoints/last.ckpt``); or
    ``last``: the newest ``checkpoints/last.ckpt`` of the runs under ``runs_root`` (other than
    the current run, ``output_dir``). None: a fresh run.
    """
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        candidates = [p for p in runs_root.glob("**/checkpoints/last.ckpt")
                      if output_dir.resolve() not in p.resolve().parents]
        if not candidates:
            raise ConfigError(
                f"ckpt_path: 'last' resumes the newest checkpoints/last.ckpt under "
                f"{str(runs_root)!r}, and there is none; pass the checkpoint file or run folder "
                "to resume, e.g. ckpt_path=outputs/<penalty>:<weight>_<date>/<time>"
            )
        path = max(candidates, key=lambda p: p.stat().st_mtime)
    else:
        path = Path(ckpt_path).expanduser()
        if path.is_dir():
            path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise ConfigError(
            f"ckpt_path: {str(path)!r} is not a file; pass a checkpoint (a run's "
            "checkpoints/*.ckpt), a run folder, or 'last'"
        )
    if not zipfile.is_zipfile(path):
        size = os.path.getsize(path)
        raise ConfigError(
            f"ckpt_path: {str(path)!r} is not a complete checkpoint ({size} bytes, "
            f"{'empty' if size == 0 else 'truncated or not written by torch.save'}); resume from "
            "another checkpoint of the run"
        )
    return path


def hydra_error(error: BaseException) -> ConfigError | None:
    """The ConfigError (caused by ``error``) of an error Hydra meets outside the app's function
    that is the user's to fix: a run (or sweep) folder it cannot create, an override that does
    not parse or names a key or group option the config does not have, a config file that is
    not YAML. None for the others, which Hydra reports."""
    message = _hydra_error_message(error)
    if message is None:
        return None
    config_error = ConfigError(message)
    config_error.__cause__ = error
    return config_error


def _hydra_error_message(error: BaseException) -> str | None:
    # (Hydra's MissingConfigException of an unknown option is an OSError too: below)
    if isinstance(error, OSError) and error.filename is not None and _raised_by_hydra(error):
        return (f"hydra.run.dir: cannot create or write {error.filename!r} "
                f"({error.strerror or error}); choose a run folder you can write: "
                "hydra.run.dir=<folder> or paths.runs=<folder> (with -m: hydra.sweep.dir or "
                "paths.sweeps)")
    if isinstance(error, OverrideParseException):
        return _override_message(error)
    if isinstance(error, MissingConfigException) and error.options:
        return _unknown_option_message(error)
    if isinstance(error, ConfigCompositionException) and isinstance(
            error.__cause__, (ConfigAttributeError, ConfigKeyError)):
        return _unknown_key_message(error.__cause__)
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, yaml.YAMLError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    # where the construct that fails starts (an unclosed bracket), else where parsing stopped
    mark = getattr(cause, "context_mark", None) or getattr(cause, "problem_mark", None)
    what = ", ".join(str(part) for part in (getattr(cause, "context", None),
                                              getattr(cause, "problem", None)) if part)
    if mark is None:
        return f"a config file is not valid YAML: {' '.join(str(cause).split())}"
    return (f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML "
            f"({what}); fix that line of the config file")


def _raised_by_hydra(error: OSError) -> bool:
    """Whether the innermost frame of ``error`` outside the standard library's file functions
    is Hydra's or its plugins' own code (creating a run or sweep folder), not the app's."""
    module = ""
    frame = error.__traceback__
    while frame is not None:
        name = frame.tb_frame.f_globals.get("__name__", "")
        if name not in ("os", "pathlib", "shutil"):
            module = name
        frame = frame.tb_next
    return module.startswith(("hydra.", "hydra_plugins."))


def _unknown_option_message(error: MissingConfigException) -> str:
    """One line for a group option that has no config file: the closest option and all."""
    group, _, option = str(error.missing_cfg_file).rpartition("/")
    options = sorted(error.options or [])
    close = difflib.get_close_matches(option, options, n=1)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return f"{group}={option}: no such option; {hint}the options of {group} are {options}"


def _unknown_key_message(error: ConfigAttributeError | ConfigKeyError) -> str:
    """One line for an override of a key the config does not have (a typo, most often): the
    closest key there and the keys it has. Hydra's advice, a ``+`` that adds the key, would
    leave a misspelt key unused."""
    parent = error.parent_node
    keys = [str(key) for key in parent if key != "hydra"] if isinstance(parent, DictConfig) else []
    close = difflib.get_close_matches(str(error.key), keys, n=1)
    where = error.full_key.rpartition(".")[0]
    hint = f"did you mean {where + '.' if where else ''}{close[0]}? " if close else ""
    return (f"{error.full_key}: no such key in the configuration; {hint}the keys "
            f"{'of ' + where if where else 'at the top'} are {keys} (a key of your own, read by "
            f"the code you add, takes a +: +{error.full_key}=...)")


def _override_message(error: OverrideParseException) -> str:
    """One line for an override Hydra's grammar rejects: the override, where, and the fix."""
    lines = [line for line in error.message.splitlines() if not line.startswith("See https")]
    if lines[0].startswith("LexerNoViableAltException: "):  # then a caret under the character
        at = lines[1].index("^") - len("LexerNoViableAltException: ")
        reason = f"{error.override[at]!r} at character {at + 1} is not in Hydra's grammar"
    else:
        reason = lines[-1]
    return (f"override {error.override!r} does not parse: {reason}. Quote a value with special "
            "characters (key='\"value\"' in the shell), write a home folder as $HOME/... (the "
            "shell expands it, not ~ after =), close brackets and quotes; Hydra's override "
            "grammar: hydra.cc, docs/advanced/override_grammar/basic")


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
