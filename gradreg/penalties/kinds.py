r"""What a penalty penalizes: its ``kind``, chosen once with the method when it is built.

* ``"gradient_norm"``: the per-sample gradient norm of :mod:`gradreg.penalties.mechanism`,
  computed by the method ``config.method`` (:data:`gradreg.penalties.methods.BUILDERS`);
* ``"spectral"``: the per-sample :math:`\hat\sigma_i \approx \sigma_{\max}(\partial f(x_i) /
  \partial x_i)` by ``iterations`` steps of power iteration
  (:func:`~gradreg.penalties.spectral_norm.spectral_norms`, differentiated through the last
  iterate), in place of :math:`\lVert g_i \rVert` in the same formula: target 0 gives
  :math:`\operatorname{reduce}_i \hat\sigma_i^2`, a Lipschitz target c with ``one_sided``
  :math:`\operatorname{reduce}_i \max(0, \hat\sigma_i - c)^2`;
* ``"hessian"``: the Hessian penalty of :mod:`gradreg.penalties.hessian_penalty` (``count``
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

from torch import Tensor

from gradreg.autograd import GradientError
from gradreg.penalties import methods
from gradreg.penalties.coupling import probe_independent_samples
from gradreg.penalties.hessian_penalty import HessianPenalty
from gradreg.penalties.methods import Method, PenaltyCall, PenaltyFunctions
from gradreg.penalties.spectral_norm import spectral_norms

if TYPE_CHECKING:
    from gradreg.penalties.config import PenaltyConfig

__all__ = ["KIND_BUILDERS", "Hessian", "Spectral", "choose"]


class Spectral:
    """Per-sample spectral norms of the input Jacobian, in the penalty of the norms. The
    Jacobian-vector products of the whole batch are per sample only where samples do not
    interact: checked on the first call (:func:`~gradreg.penalties.coupling
    .probe_independent_samples`)."""

    def __init__(self, penalty: PenaltyFunctions, config: PenaltyConfig) -> None:
        self.penalty, self.iterations, self.squared = penalty, config.iterations, config.squared
        self._checked = False

    def __call__(self, call: PenaltyCall) -> Tensor:
        norms = spectral_norms(call.forward(), call.inputs, iterations=self.iterations)
        if not self._checked:
            probe_independent_samples(call.fn, call.inputs, "kind='spectral'", call.fn_args)
            self._checked = True
        return self.penalty.of_norms(norms.square() if self.squared else norms)


class Hessian:
    """The Hessian penalty of the callable's outputs at its one input. Samples must not
    interact: the model runs at shifted inputs, so a model whose samples are coupled (BatchNorm
    in training mode, which would normalize each shifted batch by its own statistics and update
    the running statistics once per shift; a minibatch standard deviation) is refused on the
    first call (:func:`~gradreg.penalties.coupling.probe_independent_samples`)."""

    def __init__(self, config: PenaltyConfig) -> None:
        self.penalty = HessianPenalty(config.count, config.step, config.reduction, config.method)
        self._checked = False

    def __call__(self, call: PenaltyCall) -> Tensor:
        if len(call.inputs) != 1:
            raise GradientError(
                f"kind='hessian' differentiates w.r.t. one input (the latents z), got "
                f"{len(call.inputs)}: pass one tensor, or wrap the model so the others are "
                "fixed arguments (fn_args)."
            )
        if not self._checked:
            probe_independent_samples(call.fn, call.inputs, "kind='hessian'", call.fn_args)
            self._checked = True
        return self.penalty(call.forward(), call.inputs[0])


#: How each kind other than ``"gradient_norm"`` is built.
KIND_BUILDERS: dict[str, Callable[[PenaltyConfig, PenaltyFunctions], Method]] = {
    "spectral": lambda config, penalty: Spectral(penalty, config),
    "hessian": lambda config, penalty: Hessian(config),
}


def choose(config: PenaltyConfig, penalty: PenaltyFunctions) -> Method:
    """The computation of ``config.kind`` by ``config.method``, built once."""
    if config.kind == "gradient_norm":
        return methods.choose(config, penalty)
    return KIND_BUILDERS[config.kind](config, penalty)
