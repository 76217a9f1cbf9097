r"""What a penalty penalizes: its ``kind``, chosen once with the method when it is built.

* ``"gradient_norm"``: the per-sample gradient norm of :mod:`gradreg.penalties.mechanism`,
  computed by the method ``config.method`` (:data:`gradreg.penalties.methods.BUILDERS`);
* ``"spectral"``: the per-sample :math:`\hat\sigma_i \approx \sigma_{\max}(\partial f(x_i) /
  \partial x_i)` by ``iterations`` steps of power iteration
  (:func:`~gradreg.penalties.kinds.spectral.spectral_norms`, differentiated through the last
  iterate), in place of :math:`\lVert g_i \rVert` in the same formula: target 0 gives
  :math:`\operatorname{reduce}_i \hat\sigma_i^2`, a Lipschitz target c with ``one_sided``
  :math:`\operatorname{reduce}_i \max(0, \hat\sigma_i - c)^2`;
* ``"hessian"``: the Hessian penalty of :mod:`gradreg.penalties.kinds.hessian` (``count``
  directions, ``step``, ``reduction`` ``"max"`` or ``"mean"``; ``method="finite_difference"`` is the
  authors' central difference, ``"double_backward"`` the exact second directional derivatives),
  of the callable's outputs at its one input.

Both kinds other than ``"gradient_norm"`` run the model themselves (``outputs`` must be a
callable). A new kind is one more builder ``(config, penalty) -> method`` in :data:`KIND_BUILDERS`
(and its name in :data:`gradreg.penalties.config.KINDS`).

Batch splitting: per-sample values with a ``"mean"`` (or ``"sum"``) reduction do not depend on
how a batch is split into micro-batches or DDP ranks (``"spectral"``, and ``"hessian"`` with
``reduction="mean"`` over equal splits); a ``"max"`` reduction (Max-GP, the Hessian penalty's
default) is the maximum over the batch at hand, which averaging over ranks does not give.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gradreg.penalties.kinds.hessian import Hessian, HessianPenalty, hessian_penalty
from gradreg.penalties.kinds.spectral import Spectral, spectral_norms
from gradreg.penalties.state.call import Method, PenaltyFunctions

if TYPE_CHECKING:
    from gradreg.penalties.config import PenaltyConfig

__all__ = ["KIND_BUILDERS", "Hessian", "HessianPenalty", "Spectral", "hessian_penalty",
           "spectral_norms"]


#: How each kind other than ``"gradient_norm"`` is built.
KIND_BUILDERS: dict[str, Callable[[PenaltyConfig, PenaltyFunctions], Method]] = {
    "spectral": lambda config, penalty: Spectral(penalty, config),
    "hessian": lambda config, penalty: Hessian(config),
}
