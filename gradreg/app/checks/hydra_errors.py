"""What the app makes of the errors Hydra meets before the run that are the user's to fix: a run
folder it cannot create, an override that does not parse or names a key or group option the
config does not have, a config file that is not YAML; each becomes a one-line
:class:`~gradreg.app.checks.errors.ConfigError` (:func:`hydra_error`)."""

from __future__ import annotations

import difflib

import yaml
from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from .errors import ConfigError


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
