r"""The spectral norm of each sample's input Jacobian, by power iteration: a local Lipschitz bound.

For per-sample outputs :math:`f(x_i)` and :math:`J_i = \partial f(x_i)/\partial x_i`,
:math:`\sigma_{\max}(J_i)` is the largest factor by which :math:`f` stretches a small step at
:math:`x_i`. Power iteration on :math:`J_i^\top J_i`, from a random :math:`v_i \sim N(0, I)`:

.. math::

    u_i \leftarrow \frac{J_i v_i}{\lVert J_i v_i \rVert}\ \text{(JVP)}, \qquad
    v_i \leftarrow \frac{J_i^\top u_i}{\lVert J_i^\top u_i \rVert}\ \text{(VJP)},
    \qquad \hat\sigma_i = u_i^\top J_i v_i ,

all samples at once (the JVP of the batch with one tangent per sample gives every
:math:`J_i v_i`, the VJP every :math:`J_i^\top u_i`, for samples that do not interact). The
iterations run without a graph; :math:`\hat\sigma_i` is differentiated through the last iterate
only: :math:`u_i, v_i` are held fixed, as ``torch.nn.utils.parametrizations.spectral_norm`` does,
so the parameter gradient is that of :math:`u_i^\top J_i v_i` (a JVP with the graph kept, whose
backward needs second derivatives of the model). At convergence this is the gradient of
:math:`\sigma_{\max}` itself (a simple top singular value is stationary in :math:`u, v`).

The error after n iterations falls like :math:`(\sigma_2/\sigma_1)^{2n}`; :math:`\hat\sigma_i`
never exceeds :math:`\sigma_{\max}(J_i)`. Per-sample values do not depend on how a batch is split
into micro-batches or DDP ranks (for samples that do not interact: the penalty's first call
probes it, :func:`~gradreg.penalties.guards.coupling.probe_independent_samples`). Every forward of
one call (the VJP's, each JVP's) draws the random numbers of the first
(:class:`~gradreg.penalties.state.randomness.Replaying`): with dropout in training mode the
iteration runs on the Jacobian of one function, that of one mask. Cost: one forward and n + 1
Jacobian-vector products (each about a forward and a half) and n vector-Jacobian products (each
about a backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import Tensor
from torch.func import jvp, vjp

from gradreg.attention import differentiable_attention
from gradreg.autograd import GradientError, as_tuple
from gradreg.penalties.call import Configuration, Method, PenaltyCall, PenaltyFunctions
from gradreg.penalties.formulas.norms import per_sample_norm
from gradreg.penalties.guards.checks import check_outputs, model_without_in_place_updates
from gradreg.penalties.guards.coupling import probe_independent_samples
from gradreg.penalties.guards.options import (
    Option,
    check_iterations,
    check_kind_method,
    check_per_sample_kind,
    require,
)
from gradreg.penalties.state.randomness import Replaying

__all__ = ["Spectral", "SpectralMethod", "power_iteration", "spectral_norms"]


def _normalized(parts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``parts`` divided by their joint per-sample norm (a zero sample stays zero)."""
    norms = per_sample_norm(parts).clamp_min(torch.finfo(parts[0].dtype).tiny)
    return tuple(p / norms.view((-1,) + (1,) * (p.ndim - 1)) for p in parts)


def power_iteration(
    fn: Callable[..., Tensor], inputs: Tensor | Sequence[Tensor], *, iterations: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    r"""The unit vectors :math:`u_i` (outputs' shape) and :math:`v_i` (one per input, the inputs'
    shapes) after ``iterations`` steps of power iteration on :math:`J_i^\top J_i`, detached."""
    check_iterations(iterations)
    points = tuple(x.detach() for x in as_tuple(inputs))
    fn = Replaying.of(fn, "the spectral norm's power iteration",
                      partial(check_outputs, inputs=points))
    with torch.no_grad():
        _, pullback = vjp(fn, *points)
        v = _normalized(tuple(
            torch.randn(x.shape, generator=generator, dtype=torch.promote_types(
                x.dtype, torch.float32), device=x.device).to(x.dtype) for x in points))
        for _ in range(iterations):
            (u,) = _normalized((jvp(fn, points, v)[1],))
            v = _normalized(tuple(pullback(u)))
    return u, v


def spectral_norms(
    fn: Callable[..., Tensor], inputs: Tensor | Sequence[Tensor], *, iterations: int = 10,
    generator: torch.Generator | None = None,
) -> Tensor:
    r""":math:`\hat\sigma_i \approx \sigma_{\max}(\partial f(x_i)/\partial x_i)`, shape [B],
    differentiable through the last iterate (module docstring).

    ``fn(*inputs)``: per-sample outputs, batch first (a model, or a closure over extra
    arguments); ``inputs``: the points, batch first; with several inputs :math:`J_i` is the
    Jacobian w.r.t. all of them together. ``iterations``: power-iteration steps n, >= 1.
    ``generator``: for the random start.
    """
    if not callable(fn) or isinstance(fn, Tensor):
        raise GradientError(
            "the spectral norm runs the model itself (Jacobian-vector products): pass the model "
            f"(a callable fn(*points) -> per-sample outputs), not {type(fn).__name__}."
        )
    inputs = as_tuple(inputs)
    fn = Replaying.of(fn, "kind='spectral'", partial(check_outputs, inputs=inputs))
    # fused attention kernels have no forward-mode derivative: the model's attention runs through
    # gradreg's, whose JVP and its backward are written in differentiable ops
    with model_without_in_place_updates("kind='spectral'"), differentiable_attention():
        u, v = power_iteration(fn, inputs, iterations=iterations, generator=generator)
        stretched = jvp(fn, inputs, v)[1]  # J_i v_i, with the graph to the parameters
    return (u * stretched).reshape(u.shape[0], -1).sum(1)


@dataclass(frozen=True, eq=False)
class Spectral(Option):
    r"""``kind="spectral"``: the per-sample :math:`\hat\sigma_i \approx \sigma_{\max}(J_i)` by
    ``iterations`` steps of power iteration (:func:`spectral_norms`) in place of
    :math:`\lVert g_i \rVert` in the penalty of the norms; by double backward.

    Examples:
        >>> from gradreg.penalties.kinds import Spectral
        >>> Spectral(iterations=5).name
        'spectral'
        >>> Spectral(iterations=0)
        Traceback (most recent call last):
        ...
        ValueError: iterations must be an int >= 1 (power-iteration steps), got 0.
    """

    name = "spectral"
    #: The methods that compute it.
    methods: ClassVar[tuple[str, ...]] = ("double_backward",)

    iterations: int = 10

    def __post_init__(self) -> None:
        check_iterations(self.iterations)

    def check(self, config: Configuration) -> None:
        """The operator 2-norm of per-sample Jacobians, by double backward."""
        check_kind_method(self.name, config.method.name, self.methods)
        check_per_sample_kind(self.name, config)
        require(config.norm.p == 2,
                f"kind='spectral' is the operator 2-norm; got p={config.norm.p!r}")

    def build(self, config: Configuration, penalty: PenaltyFunctions) -> Method:
        return SpectralMethod(penalty, self.iterations, squared=config.norm.squared)


class SpectralMethod:
    """Per-sample spectral norms of the input Jacobian, in the penalty of the norms. The
    Jacobian-vector products of the whole batch are per sample only where samples do not
    interact: checked on the first call (:func:`~gradreg.penalties.guards.coupling
    .probe_independent_samples`)."""

    def __init__(self, penalty: PenaltyFunctions, iterations: int, *, squared: bool) -> None:
        self.penalty, self.iterations, self.squared = penalty, iterations, squared
        self._checked = False

    def __call__(self, call: PenaltyCall) -> Tensor:
        norms = spectral_norms(call.forward("kind='spectral'"), call.inputs,
                               iterations=self.iterations)
        if not self._checked:
            probe_independent_samples(call.fn, call.inputs, "kind='spectral'", call.fn_args)
            self._checked = True
        return self.penalty.of_norms(norms.square() if self.squared else norms)
