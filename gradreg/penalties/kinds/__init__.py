r"""What a penalty penalizes: its ``kind``, chosen once with the method when it is built.

* ``"gradient_norm"``: the per-sample gradient norm of :mod:`gradreg.penalties.mechanism`,
  computed by the method ``config.method`` (:data:`gradreg.penalties.methods.METHOD_TYPES`);
* ``"spectral"``: the per-sample :math:`\hat\sigma_i \approx \sigma_{\max}(\partial f(x_i) /
  \partial x_i)` by ``iterations`` steps of power iteration
  (:func:`~gradreg.penalties.kinds.spectral.spectral_norms`, differentiated through the last
  iterate), in place of :math:`\lVert g_i \rVert` in the same formula: target 0 gives
  :math:`\operatorname{reduce}_i \hat\sigma_i^2`, a Lipschitz target c with ``one_sided``
  :math:`\operatorname{reduce}_i \max(0, \hat\sigma_i - c)^2`;
* ``"hessian"``: the Hessian penalty of :mod:`gradreg.penalties.kinds.hessian` (``count``
  directions, ``epsilon``, ``reduction`` ``"max"`` or ``"mean"``;
  ``method="finite_difference"`` is the authors' central difference, ``"double_backward"``
  the exact second directional derivatives),
  of the callable's outputs at its one input.

Both kinds other than ``"gradient_norm"`` run the model themselves (``outputs`` must be a
callable). Each kind is an option object (a frozen dataclass that checks its fields, states what
it supports in ``check(config)`` and builds its computation in ``build(config, penalty)``); a
new kind is one more such class in :data:`KIND_TYPES`, whose names are :data:`KINDS`.

Batch splitting: per-sample values with a ``"mean"`` (or ``"sum"``) reduction do not depend on
how a batch is split into micro-batches or DDP ranks (``"spectral"``, and ``"hessian"`` with
``reduction="mean"`` over equal splits); a ``"max"`` reduction (Max-GP, the Hessian penalty's
default) is the maximum over the batch at hand, which averaging over ranks does not give.

Floor 4 of ``gradreg.penalties``, beside ``methods/``: the kinds hand the gradient norm to the
configuration's method through the protocol of one call (``call``, floor 3), not by importing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradreg.penalties.guards.options import Option
from gradreg.penalties.kinds.hessian import Hessian, HessianPenalty, hessian_penalty
from gradreg.penalties.kinds.spectral import Spectral, spectral_norms

if TYPE_CHECKING:
    from gradreg.penalties.call import Configuration, Method, PenaltyFunctions

__all__ = ["KINDS", "KIND_TYPES", "GradientNorm", "Hessian", "HessianPenalty", "Spectral",
           "hessian_penalty", "spectral_norms"]


@dataclass(frozen=True, eq=False)
class GradientNorm(Option):
    """``kind="gradient_norm"``: the per-sample gradient norm of
    :mod:`gradreg.penalties.mechanism`, computed by the configuration's method.

    Examples:
        >>> from gradreg.penalties.kinds import GradientNorm
        >>> GradientNorm().name
        'gradient_norm'
    """

    name = "gradient_norm"

    def check(self, config: Configuration) -> None:
        """Every method computes a gradient norm (each states what else it needs)."""

    def build(self, config: Configuration, penalty: PenaltyFunctions) -> Method:
        return config.method.build(config, penalty)


#: The kinds, whose names are the values of the flat option ``kind``.
KIND_TYPES: tuple[type[Option], ...] = (GradientNorm, Spectral, Hessian)
KINDS = tuple(kind.name for kind in KIND_TYPES)
