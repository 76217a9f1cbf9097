r"""The Hessian penalty (Peebles et al. 2020): off-diagonal Hessian terms, by their variance.

For a function :math:`G` of an input :math:`z` (a generator of its latents) and Rademacher
directions :math:`v^{(1)}, \dots, v^{(k)}` (k = ``count``; entries :math:`\pm 1` with probability
1/2, one per sample and direction), every output unit :math:`G_j` of every sample gets

.. math::

    \operatorname{Var}_{m=1..k}\big( v^{(m)\top} H_j\, v^{(m)} \big), \qquad
    H_j = \partial^2 G_j / \partial z^2,

the unbiased sample variance over the k directions (divisor k − 1, as the authors'
``torch.var(..., unbiased=True)``); its expectation is
:math:`\operatorname{Var}_v(v^\top H_j v) = 2 \sum_{a \ne b} (H_j)_{ab}^2`, zero exactly when
:math:`H_j` is diagonal (each latent acts on :math:`G_j` independently of the others). The penalty
reduces these over every sample and unit by ``max`` (the authors' default) or ``mean``, and sums
the results over the tensors when :math:`G` returns a list (several layers).

The second directional derivative :math:`v^\top H_j v` comes from one of two methods:

* ``"finite_difference"`` (the authors' code), ``step`` = ε:
  :math:`\big(G(z + \epsilon v) - 2G(z) + G(z - \epsilon v)\big)/\epsilon^2`, error
  :math:`O(\epsilon^2)` (fourth derivatives; exact for polynomials of degree <= 3); two
  forwards per direction, first-order backward only.
* ``"double_backward"`` (exact): :math:`\frac{d^2}{dt^2} G(z + t v)\big|_{t=0}` by a
  Jacobian-vector product of a Jacobian-vector product (``torch.func.jvp``, forward over
  forward: one pass gives the second directional derivative of every output unit at once,
  where reverse-mode Hessian-vector products would need one per unit); its parameter gradient
  is a backward through second derivatives (the model needs a double backward). It takes no
  ``step``.

The finite difference is refused where its rounding error could pass for curvature: each output
carries a rounding error of about :math:`u\,|G|` (:math:`u` the unit roundoff of the arithmetic
the model ran in), so the second difference carries up to :math:`4u|G|/\epsilon^2`; above 1e-2 of
the outputs' size (:func:`~gradreg.penalties.guards.precision.check_difference_rounding`; float32 at
the default ``step=0.1``: 2.4e-5, TF32: 0.2, bf16: 1.6) its variance would measure rounding noise.

Every forward of one call (the one at :math:`z`, the shifted ones, one per direction of the exact
form) draws the random numbers of the first
(:class:`~gradreg.penalties.state.randomness.Replaying`): with dropout in training mode the penalty
is that of :math:`G(\cdot\,; m)` for one mask
:math:`m`, and the finite difference differences one function.

Batch splitting: ``reduction="mean"`` over equal micro-batches (or DDP ranks) averages to the
full batch's value; ``"max"`` over the batch is not the mean of the micro-batches' maxima.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.func import jvp

from gradreg.attention import differentiable_attention
from gradreg.autograd import GradientError
from gradreg.penalties.call import Configuration, Method, PenaltyCall, PenaltyFunctions
from gradreg.penalties.guards.checks import model_without_in_place_updates
from gradreg.penalties.guards.coupling import probe_independent_samples
from gradreg.penalties.guards.options import (
    Option,
    check_count,
    check_kind_method,
    check_per_sample_kind,
    check_step,
    require,
)
from gradreg.penalties.guards.precision import check_difference_rounding
from gradreg.penalties.state.randomness import GeneratorState, Replaying, SharedForward

__all__ = [
    "DEFAULT_COUNT",
    "DEFAULT_STEP",
    "REDUCTIONS",
    "Hessian",
    "HessianMethod",
    "HessianPenalty",
    "check_hessian_options",
    "check_hessian_values",
    "hessian_penalty",
    "rademacher",
    "second_directional_derivatives",
]

#: The finite difference's step ε where ``step`` is left out (the authors' ``epsilon``).
DEFAULT_STEP = 0.1
#: Rademacher directions per sample where ``count`` is left out (the authors' ``k``).
DEFAULT_COUNT = 2

Outputs = Tensor | list[Tensor] | tuple[Tensor, ...]


def rademacher(shape: tuple[int, ...], *, like: Tensor,
               generator: torch.Generator | None = None) -> Tensor:
    """A tensor of ``shape`` with entries -1 and +1, each with probability 1/2 (``like``'s
    dtype and device)."""
    bits = torch.randint(0, 2, shape, generator=generator, device=like.device)
    return (bits * 2 - 1).to(like.dtype)


def _as_list(outputs: Outputs) -> list[Tensor]:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def second_directional_derivatives(
    fn: Callable[[Tensor], Outputs], z: Tensor, direction: Tensor, *,
    method: str = "finite_difference", step: float = DEFAULT_STEP,
    outputs: Outputs | None = None,
) -> list[Tensor]:
    r""":math:`v^\top H_j v` for every output unit :math:`j` of every tensor ``fn(z)`` returns,
    for one direction :math:`v` (``direction``, ``z``'s shape): a list with one tensor of each
    output's shape. ``outputs``: ``fn(z)`` where already computed (finite difference only; the
    shifted forwards replay the random state of the first forward they see, so a model that
    draws random numbers needs ``outputs`` left out)."""
    if method == "double_backward":
        def tangent(q: Tensor) -> Outputs:
            return jvp(fn, (q,), (direction,))[1]
        # fused attention kernels have no forward-mode derivative: the model's attention runs
        # through gradreg's, whose JVP is written in differentiable ops
        with (model_without_in_place_updates("kind='hessian' with the exact method"),
              differentiable_attention()):
            return _as_list(jvp(tangent, (z,), (direction,))[1])
    forward = Replaying(fn if outputs is None else SharedForward(fn, z, outputs, None),
                        "the Hessian penalty")
    at_z = _as_list(forward(z))
    _check_rounding(at_z, step)
    return _second_difference(forward, z, direction, step, at_z)


def _check_rounding(at_z: list[Tensor], step: float) -> None:
    """Refuse a second difference at ``step`` that rounding would swamp (module docstring)."""
    check_difference_rounding(
        at_z, step=step, order=2, weight=4, step_name="step",
        exact="the exact form (method='double_backward')",
        what="the Hessian penalty's second difference (G(z+eps*v) - 2G(z) + G(z-eps*v))/eps^2")


def _second_difference(fn: Callable[[Tensor], Outputs], z: Tensor, direction: Tensor,
                       step: float, at_z: list[Tensor]) -> list[Tensor]:
    """(G(z + εv) − 2G(z) + G(z − εv))/ε² for each output, ``at_z`` being G(z)."""
    shift = step * direction
    plus, minus = _as_list(fn(z + shift)), _as_list(fn(z - shift))
    if not len(plus) == len(minus) == len(at_z):
        raise GradientError(
            f"fn returned {len(at_z)} tensors at z but {len(plus)} at a shifted z: "
            "it must return the same list of outputs for every input."
        )
    return [(p - 2 * g + m) / step**2 for p, g, m in zip(plus, at_z, minus, strict=True)]


#: The reductions of the Hessian penalty over samples and output units.
REDUCTIONS = ("max", "mean")


def check_hessian_options(*, count: int | None, step: float | None, reduction: str,
                          method: str) -> None:
    """Refuse options the Hessian penalty cannot take, for ``kind="hessian"`` and for
    :func:`~gradreg.penalties.kinds.hessian.hessian_penalty`: ``count`` Rademacher
    directions per sample, an int >= 2 (the penalty is a variance over them); ``step`` > 0;
    ``reduction`` one of :data:`REDUCTIONS`; ``method`` one of :attr:`Hessian.methods`.
    ``None`` leaves ``count`` or ``step`` at its default."""
    check_kind_method("hessian", method, Hessian.methods)
    check_hessian_values(count=count, step=step, reduction=reduction)


def check_hessian_values(*, count: int | None, step: float | None, reduction: str,
                         step_name: str = "step") -> None:
    """The values of :func:`check_hessian_options`, the method apart (the step named
    ``step_name``: the :class:`Hessian` option calls it ``epsilon``)."""
    require(reduction in REDUCTIONS,
            f"kind='hessian' reduces by 'max' (the authors' default) or 'mean', got "
            f"reduction={reduction!r}")
    check_count(count, 2, ": the Hessian penalty is a variance over the directions, which needs "
                          "two")
    check_step(step, step_name)


def hessian_penalty(
    fn: Callable[[Tensor], Outputs],
    z: Tensor,
    *,
    count: int | None = None,
    step: float | None = None,
    reduction: str = "max",
    method: str = "finite_difference",
    outputs: Outputs | None = None,
    directions: Tensor | None = None,
    generator: torch.Generator | None = None,
    random_state: GeneratorState | None = None,
) -> Tensor:
    r"""The Hessian penalty of ``fn`` at ``z`` (module docstring), a differentiable scalar.

    ``fn(z)``: a tensor or a list of tensors (layers), batch first; ``z``: the input, batch first.
    ``count``: Rademacher directions per sample, >= 2 (a variance needs two; ``None``:
    :data:`DEFAULT_COUNT`); ``step`` > 0: the finite-difference step ε (``None``:
    :data:`DEFAULT_STEP`); ``reduction``: ``"max"`` or ``"mean"`` over samples and units;
    ``method``: ``"finite_difference"`` or ``"double_backward"`` (exact). The options are
    checked by :func:`check_hessian_options`, as ``kind="hessian"``'s
    are. ``outputs``: ``fn(z)`` where the caller already computed it (finite difference: saves
    a forward), with ``random_state`` the random state its forward began with (replayed by the
    shifted forwards; needed where the model draws random numbers). ``directions``: the
    directions themselves, shape [count, *z.shape] (to reproduce a draw); else drawn from
    ``generator``.
    """
    check_hessian_options(count=count, step=step, reduction=reduction, method=method)
    return HessianPenalty(count, step, reduction, method)(
        fn, z, outputs=outputs, directions=directions, generator=generator,
        random_state=random_state)


@dataclass(frozen=True)
class HessianPenalty:
    """The Hessian penalty with its options, called as ``penalty(fn, z, ...)`` with the further
    arguments of :func:`hessian_penalty`. The options are checked where they are given
    (:func:`hessian_penalty`, or a :class:`~gradreg.penalties.config.PenaltyConfig` of
    ``kind="hessian"``), not on every call; ``None`` leaves ``count`` or ``step`` at its
    default."""

    count: int | None = None
    step: float | None = None
    reduction: str = "max"
    method: str = "finite_difference"

    def __call__(self, fn: Callable[[Tensor], Outputs], z: Tensor, *,
                 outputs: Outputs | None = None, directions: Tensor | None = None,
                 generator: torch.Generator | None = None,
                 random_state: GeneratorState | None = None) -> Tensor:
        count = DEFAULT_COUNT if self.count is None else self.count
        step = DEFAULT_STEP if self.step is None else self.step
        if not isinstance(z, Tensor) or not z.is_floating_point():
            raise GradientError(
                f"the Hessian penalty needs a floating-point input z, got "
                f"{z.dtype if isinstance(z, Tensor) else type(z).__name__}."
            )
        if directions is None:
            directions = rademacher((count, *z.shape), like=z, generator=generator)
        elif tuple(directions.shape) != (count, *z.shape):
            raise GradientError(
                f"directions have shape {tuple(directions.shape)}; expected [count, *z.shape] = "
                f"{[count, *z.shape]}."
            )
        forward = Replaying.of(
            fn if outputs is None else SharedForward(fn, z, outputs, random_state),
            "the Hessian penalty")
        if self.method == "double_backward":
            per_direction = [
                second_directional_derivatives(forward, z, v, method="double_backward")
                for v in directions]
        else:  # one forward at z and one rounding check, shared by the directions
            at_z = _as_list(forward(z))
            _check_rounding(at_z, step)
            per_direction = [_second_difference(forward, z, v, step, at_z) for v in directions]
        total = None
        for layer in zip(*per_direction, strict=True):  # count tensors of one output's shape
            variance = torch.stack(layer).var(dim=0, correction=1)
            value = variance.amax() if self.reduction == "max" else variance.mean()
            total = value if total is None else total + value
        return total


@dataclass(frozen=True, eq=False)
class Hessian(Option):
    """``kind="hessian"``: the Hessian penalty (module docstring) with ``count`` Rademacher
    directions per sample (>= 2, ``None``: :data:`DEFAULT_COUNT`), the second difference's
    step ``epsilon`` ε (``None``: :data:`DEFAULT_STEP`; by ``method="finite_difference"`` only;
    the flat alias ``step``) and the
    ``reduction`` ``"max"`` (the authors') or ``"mean"`` over samples and units; by
    ``method="finite_difference"`` (the authors' central difference) or ``"double_backward"``
    (exact second directional derivatives).

    Examples:
        >>> from gradreg.penalties.kinds import Hessian
        >>> Hessian(count=4, epsilon=0.05).epsilon
        0.05
        >>> Hessian(count=1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: count (random directions per sample) must be an int >= 2 or None ... got 1.
    """

    name = "hessian"
    #: The methods that compute it.
    methods: ClassVar[tuple[str, ...]] = ("finite_difference", "double_backward")

    count: int | None = None
    epsilon: float | None = None
    reduction: str = "max"

    def __post_init__(self) -> None:
        check_hessian_values(count=self.count, step=self.epsilon, reduction=self.reduction,
                             step_name="epsilon")

    @classmethod
    def step_field(cls, flat: dict[str, Any]) -> str | None:
        return "epsilon"

    def check(self, config: Configuration) -> None:
        """A variance of second derivatives, not a norm: the norm's options at their
        defaults."""
        check_kind_method(self.name, config.method.name, self.methods)
        check_per_sample_kind(self.name, config)
        norm = config.norm
        require(norm.target == 0 and not norm.one_sided and norm.power == 2 and norm.p == 2,
                "kind='hessian' penalizes a variance, not a norm: target, one_sided, power "
                "and p do not apply; leave them at their defaults")
        require(self.epsilon is None or config.method.name == "finite_difference",
                f"epsilon is the step of kind='hessian' by method='finite_difference'; "
                f"method={config.method.name!r} takes none: leave it out")

    def build(self, config: Configuration, penalty: PenaltyFunctions) -> Method:
        return HessianMethod(HessianPenalty(self.count, self.epsilon, self.reduction,
                                            config.method.name))


class HessianMethod:
    """The Hessian penalty of the callable's outputs at its one input. Samples must not
    interact: the model runs at shifted inputs, so a model whose samples are coupled (BatchNorm
    in training mode, which would normalize each shifted batch by its own statistics and update
    the running statistics once per shift; a minibatch standard deviation) is refused on the
    first call (:func:`~gradreg.penalties.guards.coupling.probe_independent_samples`)."""

    def __init__(self, penalty: HessianPenalty) -> None:
        self.penalty = penalty
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
        return self.penalty(call.forward("the Hessian penalty", checked=False), call.inputs[0])
