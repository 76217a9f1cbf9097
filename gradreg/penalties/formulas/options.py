r"""The norm of a penalty, one frozen value that checks its own fields (:class:`Norm`).

With per-sample gradients :math:`g_i` formed by ``projection`` (of derivative order ``order``),
the penalty of the norms is

.. math::

    \operatorname{reduce}_i \big( \phi(\lVert g_i \rVert_p - c) \big)^{\text{power}},
    \qquad \phi(t) = \max(0, t) \text{ if one-sided else } |t|,

with :math:`c` the ``target`` (or, ``target="ema"``, StyleGAN2's running mean of the norms
with decay ``ema_decay``) and the reduction a mean, a sum or a maximum over samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradreg.penalties.formulas.norms import REDUCE, squared_norm_penalty
from gradreg.penalties.formulas.projections import PROJECTIONS
from gradreg.penalties.guards.options import (
    Option,
    check_count,
    check_flag,
    finite_number,
    require,
)

__all__ = ["PROJECTION_NAMES", "REDUCTIONS", "Norm"]

#: The reductions over samples (those of :data:`~gradreg.penalties.formulas.norms.REDUCE` but
#: the per-sample ``"none"``).
REDUCTIONS = tuple(name for name in REDUCE if name != "none")
#: Where the per-sample gradient comes from (the keys of
#: :data:`~gradreg.penalties.formulas.projections.PROJECTIONS`).
PROJECTION_NAMES = tuple(PROJECTIONS)


def _number(option: Option, name: str, *, infinite: bool = False) -> float:
    """The option ``name`` of ``option`` as a float (a numpy scalar or a 0-d tensor is
    converted in place, an int or a float kept as written)."""
    value = getattr(option, name)
    converted = finite_number(name, value, infinite=infinite)
    if type(value) not in (int, float):
        object.__setattr__(option, name, converted)
    return converted


@dataclass(frozen=True, eq=False)
class Norm(Option):
    r"""The norm and its penalty (module docstring).

    Attributes:
        target: the target c >= 0 (0 for R1/R2/double backprop, 1 for WGAN-GP), or ``"ema"``.
        one_sided: penalize only norms above the target (WGAN-LP).
        power: exponent of the deviation, > 0.
        p: the norm's order, > 0 (``inf``: the max-norm).
        reduction: ``"mean"``, ``"sum"`` or ``"max"`` over samples (Max-GP).
        projection: ``"sum"``, ``"orthonormal"`` or ``"gaussian"``
            (:mod:`~gradreg.penalties.formulas.projections`).
        order: derivative order n of the ``"sum"`` projection.
        count: orthonormal projections per sample (``None``: 1; only with ``"orthonormal"``).
        ema_decay: the running mean's decay for ``target="ema"``, in (0, 1].

    Examples:
        >>> from gradreg.penalties.formulas.options import Norm
        >>> Norm(target=1.0).squared, Norm().squared  # WGAN-GP's, R1's
        (False, True)
        >>> Norm(order=2, projection="gaussian")
        Traceback (most recent call last):
        ...
        ValueError: order > 1 needs projection='sum'.
    """

    name = "norm"

    target: float | str = 0.0
    one_sided: bool = False
    power: float = 2.0
    p: float = 2.0
    reduction: str = "mean"
    projection: str = "sum"
    order: int = 1
    count: int | None = None
    ema_decay: float = 0.01

    def __post_init__(self) -> None:
        if self.target != "ema":
            target = _number(self, "target")
            require(target >= 0, f"target must be a number >= 0 or 'ema', got {self.target!r}")
        require(_number(self, "power") > 0, f"power must be > 0, got {self.power!r}")
        require(_number(self, "p", infinite=True) > 0,
                f"p (the norm's order) must be > 0, got {self.p!r}")
        _number(self, "ema_decay")
        check_flag("one_sided", self.one_sided)
        require(self.reduction in REDUCTIONS,
                f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        require(self.projection in PROJECTION_NAMES,
                f"projection must be one of {PROJECTION_NAMES}, got {self.projection!r}")
        require(isinstance(self.order, int) and self.order >= 1,
                f"order must be an int >= 1, got {self.order!r}")
        require(self.order == 1 or self.projection == "sum", "order > 1 needs projection='sum'")
        require(0 < self.ema_decay <= 1, f"ema_decay must be in (0, 1], got {self.ema_decay!r}")
        check_count(self.count)
        require(self.count is None or self.projection == "orthonormal",
                f"count sets the directions of projection='orthonormal'; it does nothing with "
                f"projection={self.projection!r}: leave it out")

    @classmethod
    def flat_keys(cls, flat: dict[str, Any]) -> tuple[str, ...]:
        """Its fields, ``count`` only with ``projection="orthonormal"`` (the other projections
        draw no directions)."""
        keys = super().flat_keys(flat)
        return keys if flat["projection"] == "orthonormal" else tuple(
            key for key in keys if key != "count")

    @property
    def squared(self) -> bool:
        """Target 0, power 2, norm order 2: the penalty is the squared norm, taken without a
        root (whose derivative is infinite at a zero norm)."""
        return squared_norm_penalty(self.target, self.power, self.p)

    @property
    def numeric_target(self) -> bool:
        """Whether the target is a number (not StyleGAN2's running mean, which couples the
        samples of a batch)."""
        return self.target != "ema"
