"""The terms of a step's loss, handed to a callback that asks for them on that step.

A module calls :func:`record_terms` with the parts of the loss it is about to backpropagate
(``{"task": ..., "<penalty>": weighted penalty, ...}``, summing to that loss) right before its
backward; the terms are kept only where a callback asked for this step (:func:`request_terms`,
e.g. :class:`~gradreg.lightning.callbacks.GradientSplit` on its logging steps), and the callback
takes them (:func:`take_terms`) in ``on_before_backward``, so nothing of a step outlives it and
a step nobody asked about costs one attribute read.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

TASK = "task"
_REQUESTED, _TERMS = "_gradreg_terms_requested", "_gradreg_terms"


def request_terms(module: nn.Module, requested: bool = True) -> None:
    """Ask ``module`` to keep the terms of its next :func:`record_terms` (or stop asking)."""
    setattr(module, _REQUESTED, requested)


def terms_requested(module: nn.Module) -> bool:
    """Whether a callback asked ``module`` for the terms of its next :func:`record_terms`."""
    return getattr(module, _REQUESTED, False)


def record_terms(module: nn.Module, terms: Mapping[str, Tensor]) -> None:
    """Keep ``terms`` (name -> scalar with its graph; :data:`TASK` for the task loss) on
    ``module`` if a callback asked for them; nothing otherwise."""
    if terms_requested(module):
        setattr(module, _TERMS, dict(terms))


def take_terms(module: nn.Module) -> dict[str, Tensor] | None:
    """The terms :func:`record_terms` kept (None if none), removed from ``module``."""
    return module.__dict__.pop(_TERMS, None)
