"""Finding the gradient penalties inside a user's module, and what the dashboards show of them."""

from __future__ import annotations

from torch import Tensor, nn

from gradreg.lightning.dashboards.tags import PENALTY_UNWEIGHTED, PENALTY_WEIGHT, PENALTY_WEIGHTED
from gradreg.penalties import GradientPenalty


def named_penalties(module: nn.Module) -> dict[str, GradientPenalty]:
    """Every :class:`GradientPenalty` submodule of ``module``, by dotted path (``penalties.gp``)."""
    return {
        name: child for name, child in module.named_modules() if isinstance(child, GradientPenalty)
    }


def penalty_weights(module: nn.Module) -> dict[str, float]:
    """Every penalty's current weight :math:`\\lambda`, by module path."""
    return {name: float(penalty.weight) for name, penalty in named_penalties(module).items()}


def penalty_scalars(module: nn.Module) -> dict[str, Tensor | float]:
    """``penalty/weight/<path>`` of every penalty and, once it has been called,
    ``penalty/unweighted/<path>`` (``last_value``) and ``penalty/weighted/<path>``
    (``penalty.factor * last_value``, the term the loss got at that call)."""
    scalars: dict[str, Tensor | float] = {}
    for name, penalty in named_penalties(module).items():
        scalars[f"{PENALTY_WEIGHT}/{name}"] = float(penalty.weight)
        if penalty.last_value is not None:
            scalars[f"{PENALTY_UNWEIGHTED}/{name}"] = penalty.last_value
            scalars[f"{PENALTY_WEIGHTED}/{name}"] = penalty.last_value * penalty.factor
    return scalars
