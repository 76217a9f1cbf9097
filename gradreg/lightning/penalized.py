"""What the Lightning modules with penalties share: the optimizer factory they take, the check
that a module can evaluate its penalties, the end-of-epoch wait for their finite checks, and the
identity their checkpoints carry (:class:`PenalizedModule`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import lightning as L
import torch
from torch import nn

from gradreg.penalties import PRESETS, GradientPenalty

__all__ = ["CHECKPOINT_SCHEMA", "OptimizerFactory", "PenalizedModule", "check_penalties",
           "checkpoint_identity", "checkpoint_mismatch", "settle_finite_checks"]

#: Builds an optimizer from parameters, e.g. ``partial(torch.optim.Adam, lr=1e-3)``.
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def settle_finite_checks(penalties: Mapping[str, GradientPenalty]) -> None:
    """Raise for a non-finite penalty value whose asynchronous check is still pending (on a GPU
    the per-step check never waits for the device; this waits once, at the end of an epoch)."""
    for penalty in penalties.values():
        penalty.finite_check.settle()


def check_penalties(
    penalties: Mapping[str, GradientPenalty], module: nn.Module, supported: Sequence[str], kind: str
) -> None:
    """Raise ``ValueError`` naming the penalty and the valid values if ``kind`` cannot apply it."""
    names = [name for name, _ in module.named_modules() if name]
    for key, penalty in penalties.items():
        if penalty.config.points not in supported:
            presets = [name for name, preset in PRESETS.items() if preset["points"] in supported]
            raise ValueError(
                f"penalty {key!r} has points={penalty.config.points!r}, which a {kind} cannot "
                f"evaluate; a {kind} supports points {list(supported)}, i.e. the presets "
                f"{presets}"
            )
        unknown = [layer for layer in penalty.config.layers if layer not in names]
        if unknown:
            raise ValueError(
                f"penalty {key!r} has layers={unknown}, not submodules of the model; "
                f"valid layers: {names}"
            )


#: The version of what :func:`checkpoint_identity` writes under ``checkpoint["gradreg"]``.
CHECKPOINT_SCHEMA = 1


def checkpoint_identity(module: nn.Module) -> dict[str, Any]:
    """What a checkpoint of ``module`` is of: the schema version, the module's class and its
    penalties (name -> the points each differentiates against)."""
    penalties = getattr(module, "penalties", {})
    return {"schema": CHECKPOINT_SCHEMA,
            "module": f"{type(module).__module__}.{type(module).__qualname__}",
            "penalties": {name: penalty.config.points for name, penalty in penalties.items()}}


def _describe(identity: Mapping[str, Any]) -> str:
    penalties = ", ".join(f"{name} (points={points})"
                          for name, points in identity["penalties"].items()) or "none"
    return f"{identity['module'].rsplit('.', 1)[-1]} with penalties {penalties}"


def checkpoint_mismatch(checkpoint: Mapping[str, Any], module: nn.Module) -> str | None:
    """Why ``module`` cannot resume from ``checkpoint`` (a loaded Lightning checkpoint), in words
    naming both sides; None where it can.

    A checkpoint with an identity (``checkpoint["gradreg"]``, written by :class:`PenalizedModule`)
    must be of the same module class and penalty set; every checkpoint, one without an identity
    included, must hold the module's state names with their shapes."""
    saved = checkpoint.get("gradreg")
    if saved is not None:
        if saved.get("schema", 0) > CHECKPOINT_SCHEMA:
            return (f"a checkpoint of schema {saved['schema']}, written by a newer gradreg "
                    f"(this one reads schema {CHECKPOINT_SCHEMA})")
        current = checkpoint_identity(module)
        if (saved["module"], saved["penalties"]) != (current["module"], current["penalties"]):
            return f"a checkpoint of {_describe(saved)}; this run builds {_describe(current)}"
    state = checkpoint.get("state_dict", {})
    expected = {name: tuple(value.shape) for name, value in module.state_dict().items()
                if isinstance(value, torch.Tensor)}
    stored = {name: tuple(value.shape) for name, value in state.items()
              if isinstance(value, torch.Tensor)}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(stored.keys() - expected.keys())
    resized = [f"{name} {list(stored[name])} (here {list(shape)})"
               for name, shape in expected.items() if name in stored and stored[name] != shape]
    problems = [f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                for what, names in (("lacks", missing), ("has extra", unexpected),
                                    ("has other shapes", resized)) if names]
    if problems:
        return (f"a checkpoint of another model than this run's {type(module).__name__}: it "
                + "; ".join(problems))
    return None


class PenalizedModule(L.LightningModule):
    """A LightningModule whose checkpoints say what they are of (:func:`checkpoint_identity`,
    under ``checkpoint["gradreg"]``) and which refuses, with ``ValueError`` naming both sides,
    to resume from a checkpoint of another module or penalty set (:func:`checkpoint_mismatch`),
    where Lightning would fail inside ``load_state_dict`` with a list of keys."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["gradreg"] = checkpoint_identity(self)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        mismatch = checkpoint_mismatch(checkpoint, self)
        if mismatch is not None:
            raise ValueError(f"cannot resume from {mismatch}")
