"""Finding the gradient penalties inside a user's module."""

from __future__ import annotations

from torch import nn

from gradreg.penalties import GradientPenalty


def named_penalties(module: nn.Module) -> dict[str, GradientPenalty]:
    """Every :class:`GradientPenalty` submodule of ``module``, by dotted path (``penalties.gp``)."""
    return {
        name: child for name, child in module.named_modules() if isinstance(child, GradientPenalty)
    }
