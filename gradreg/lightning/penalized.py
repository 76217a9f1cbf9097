"""What the Lightning modules with penalties share: the optimizer factory they take, the check
that a module can evaluate its penalties, and the end-of-epoch wait for their finite checks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from gradreg.penalties import PRESETS, GradientPenalty

__all__ = ["OptimizerFactory", "check_penalties", "settle_finite_checks"]

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
        if penalty.points not in supported:
            presets = [name for name, preset in PRESETS.items() if preset["points"] in supported]
            raise ValueError(
                f"penalty {key!r} has points={penalty.points!r}, which a {kind} cannot evaluate; "
                f"a {kind} supports points {list(supported)}, i.e. the presets {presets}"
            )
        unknown = [layer for layer in penalty.layers if layer not in names]
        if unknown:
            raise ValueError(
                f"penalty {key!r} has layers={unknown}, not submodules of the model; "
                f"valid layers: {names}"
            )
