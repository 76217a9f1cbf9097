r"""Squared per-sample gradient norms from random perturbations: no double backward.

For per-sample outputs :math:`f(x_i) \in \mathbb{R}^K` (a critic score, a per-sample loss,
logits) and a probe :math:`\varepsilon_i \sim N(0, I)` of each sample's shape,

.. math::

    \widehat{s}_i = \frac{\lVert f(x_i + \sigma\varepsilon_i) - f(x_i) \rVert^2}{\sigma^2}
                  = \lVert J_i \varepsilon_i \rVert^2 + O(\sigma)\text{ terms of mean zero}
                    + O(\sigma^2),
    \qquad \mathbb{E}_\varepsilon \lVert J_i \varepsilon_i \rVert^2 = \lVert J_i \rVert_F^2,

with :math:`J_i = \partial f(x_i)/\partial x_i` (for a scalar output, :math:`\lVert J_i\rVert_F^2
= \lVert \nabla f(x_i) \rVert^2`, the R1/R2 and double-backprop norm). Dividing by
:math:`\sigma^2` makes it an estimate of the same squared norm the exact penalties use, so a weight
means the same coefficient. This is the Seaweed APT approximation of R1 (Lin et al. 2025,
``‖D(x) − D(x + σε)‖²``, σ = 0.01) rescaled.

Error in expectation over the probes (Taylor expansion, :math:`H_i`, :math:`T_i` the second and
third derivatives along :math:`\varepsilon`):

* forward difference: :math:`\frac{\sigma^2}{4}\,\mathbb{E}(\varepsilon^\top H\varepsilon)^2
  + \frac{\sigma^2}{3}\,\mathbb{E}(\varepsilon^\top g)\,T[\varepsilon^3] = O(\sigma^2)`
  (the :math:`O(\sigma)` term :math:`\sigma (\varepsilon^\top g)(\varepsilon^\top H
  \varepsilon)` has mean zero: odd moments of a Gaussian vanish);
* ``central=True``, :math:`\frac{f(x+\sigma\varepsilon) - f(x-\sigma\varepsilon)}{2\sigma}`:
  the Hessian terms cancel, :math:`\frac{\sigma^2}{3}\,\mathbb{E}(\varepsilon^\top g)\,
  T[\varepsilon^3] + O(\sigma^4)`, at one more forward (:math:`f(x)` is not used).

Rounding adds a relative error of about :math:`u\,|f| / (\sigma \lVert g\rVert)` (:math:`u` the
unit roundoff) to each difference: measured figures, and the step where float32 rounding starts to
dominate, are in ``docs/benchmarks.md``. Arithmetic whose rounding moves the quotient by more
than 1e-2 of the outputs' size, :math:`2u/\sigma` (:math:`u/\sigma` central), is refused
(:func:`~gradreg.penalties.guards.precision.check_difference_rounding`): bf16 autocast or TF32 at
the default σ (0.78 and 0.098). The variance over the probes is that of
:math:`(\varepsilon^\top g)^2`, :math:`2\lVert g\rVert^4` for a scalar output: one probe gives a
relative standard deviation of :math:`\sqrt2` per sample, ``count=k`` probes divide the variance by
k.

The estimate is an ordinary differentiable function of the parameters (first-order backward
only): its parameter gradient is :math:`2 (\varepsilon^\top g)\,\nabla_\theta(\varepsilon^\top g)
+ O(\sigma)`, whose mean over the probes is :math:`\nabla_\theta \lVert g \rVert^2`. It works
where the model has no double backward (``@once_differentiable`` ops, fused attention kernels).
Samples must not interact: each is moved by its own probe (a model whose samples are coupled,
BatchNorm in training mode or a minibatch standard deviation, is refused:
:func:`~gradreg.penalties.guards.coupling.check_independent_samples`). Every forward of one call
draws the random numbers of the first (dropout's mask: :mod:`~gradreg.penalties.state.randomness`),
so with random layers the estimate is that of :math:`f(\cdot\,; m)` for the mask :math:`m` of the
forward at :math:`x`, which the caller's task loss may share
(:class:`~gradreg.penalties.state.randomness .SharedForward`). Per-sample estimates do not depend on
how a batch is split into micro-batches or DDP ranks (the probes are random, so the numbers do, but
not their distribution).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from gradreg.autograd import GradientError, as_tuple
from gradreg.penalties.call import Configuration, Method, PenaltyCall, PenaltyFunctions
from gradreg.penalties.guards.checks import check_outputs
from gradreg.penalties.guards.compiled import runs_compiled
from gradreg.penalties.guards.coupling import check_independent_samples, probe_independent_samples
from gradreg.penalties.guards.options import Option, check_count, check_flag, check_step, require
from gradreg.penalties.guards.precision import check_difference_rounding
from gradreg.penalties.state.randomness import GeneratorState, Replaying, SharedForward

__all__ = ["DEFAULT_COUNT", "DEFAULT_STEP", "Perturbation", "PerturbationMethod",
           "perturbation_sq_norms"]

#: The probe's scale σ per element (``step``), Seaweed APT's ``sigma = 0.01``.
DEFAULT_STEP = 0.01
#: Probes per sample (``count``).
DEFAULT_COUNT = 1


def perturbation_sq_norms(
    fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    *,
    outputs: Tensor | None = None,
    step: float = DEFAULT_STEP,
    central: bool = False,
    count: int = DEFAULT_COUNT,
    generator: torch.Generator | None = None,
    random_state: GeneratorState | None = None,
    check_samples: bool = True,
    losses: bool = False,
) -> Tensor:
    r"""Per-sample estimates of :math:`\lVert \partial f(x_i)/\partial x_i \rVert_F^2`, shape [B].

    ``fn(*inputs)`` returns per-sample outputs ([B] or [B, ...]); ``inputs`` are tensors with the
    batch first (they need not require grad; every one is perturbed, each by its own probe, and
    the estimate is of the norm over all of them). ``outputs``: ``fn(*inputs)`` where the caller
    already computed it (the critic's scores of the reals for its loss), to share that forward;
    it is not used with ``central=True``; ``random_state``: the random state that forward began
    with (:meth:`~gradreg.penalties.state.randomness.GeneratorState.capture` before it), replayed by
    the perturbed forwards (needed where the model draws random numbers).
    ``fn`` may also be a :class:`~gradreg.penalties.state.randomness.SharedForward` (outputs and
    state in one). ``step``: the probe's scale σ per element, > 0.
    ``count``: probes per sample, averaged (each one forward of the batch, two when central).
    ``generator``: the random generator of the probes (drawn in float32, then cast to each
    input's dtype, so float64, float32 and bf16 runs with one seed draw the same probes).
    ``check_samples``: probe that the samples do not interact (one backward of the first
    perturbed forward; a method runs it on its first call only). ``losses``: ``fn`` returns
    per-sample losses (a penalty with ``of="loss"``), so outputs with more than one value per
    sample (logits) are refused.

    The mean over probes of :math:`\lVert f(x_i + \sigma\varepsilon_i) - f(x_i)\rVert^2/\sigma^2`
    (or of :math:`\lVert f(x_i+\sigma\varepsilon_i) - f(x_i-\sigma\varepsilon_i)\rVert^2 /
    (2\sigma)^2`); bias :math:`O(\sigma^2)` in both cases, see the module docstring.
    """
    if not callable(fn) or isinstance(fn, Tensor):
        raise GradientError(
            f"the perturbation estimate runs the model itself at perturbed points: pass the "
            f"model (a callable fn(*points) -> per-sample outputs), not {type(fn).__name__}."
        )
    inputs = as_tuple(inputs)
    if not (isinstance(step, (int, float)) and step > 0):
        raise ValueError(f"step (the probe's scale σ) must be a number > 0, got {step!r}.")
    if not (isinstance(count, int) and count >= 1):
        raise ValueError(f"count must be an int >= 1 (probes per sample), got {count!r}.")
    for x in inputs:
        if not x.is_floating_point():
            raise GradientError(
                f"the perturbation estimate needs floating-point inputs, got {x.dtype}: convert "
                "the data first, e.g. images.float() / 255."
            )
    forward = Replaying.of(
        fn if outputs is None else SharedForward(fn, inputs[0], outputs, random_state),
        "the perturbation estimate", partial(check_outputs, inputs=inputs, losses=losses))
    if not central:
        outputs = forward(*inputs)
    total = None
    for probe in range(count):
        shifts = tuple(_probe(x, generator) * step for x in inputs)
        shifted = tuple(x + s for x, s in zip(inputs, shifts, strict=True))
        if check_samples and probe == 0:
            shifted = tuple(q if q.requires_grad else q.requires_grad_() for q in shifted)
        plus = forward(*shifted)
        if probe == 0:
            check_difference_rounding(
                [plus], step=step, order=1, weight=1 if central else 2, step_name="step",
                what="the perturbation estimate's difference quotient of outputs",
                exact="method='double_backward' (r1/r2 instead of approx_r1/approx_r2)")
            if check_samples and runs_compiled(plus):  # one backward per compiled graph
                probe_independent_samples(fn, shifted, "the perturbation estimate")
            elif check_samples:
                check_independent_samples(plus, shifted, "the perturbation estimate")
        if central:
            minus = forward(*(x - s for x, s in zip(inputs, shifts, strict=True)))
            delta = (plus - minus) / 2
        else:
            delta = plus - outputs
        sq = delta.reshape(delta.shape[0], -1).square().sum(1) / (step * step)
        total = sq if total is None else total + sq
    return total / count


def _probe(x: Tensor, generator: torch.Generator | None) -> Tensor:
    """:math:`\\varepsilon \\sim N(0, I)` of ``x``'s shape, drawn in float32 and cast to
    ``x``'s dtype: one seed gives the same probes to float64, float32 and bf16 runs."""
    draw = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=x.device)
    return draw.to(x.dtype)


@dataclass(frozen=True, eq=False)
class Perturbation(Option):
    r"""``method="perturbation"``: the squared per-sample norms estimated from ``count``
    perturbed forwards per sample of scale ``sigma`` (σ; the flat alias ``step``), central
    differences with ``central`` (:func:`perturbation_sq_norms`), no double backward; only for
    squared norms with target 0 (R1, R2, double backprop, the Jacobian). ``None``: the defaults
    (:data:`DEFAULT_STEP`, :data:`DEFAULT_COUNT`).

    Examples:
        >>> from gradreg.penalties.methods import Perturbation
        >>> Perturbation(sigma=0.01, count=4, central=True).count
        4
        >>> Perturbation(central="yes")
        Traceback (most recent call last):
        ...
        ValueError: central is a flag: pass True or False, got 'yes'.
    """

    name = "perturbation"

    sigma: float | None = None
    count: int | None = None
    central: bool = False

    def __post_init__(self) -> None:
        check_step(self.sigma, "sigma")
        check_count(self.count)
        check_flag("central", self.central)

    @classmethod
    def step_field(cls, flat: dict[str, Any]) -> str | None:
        return "sigma"

    def check(self, config: Configuration) -> None:
        """Refuse what the estimate does not compute: norms that are not squared with target 0,
        higher orders, the Gaussian projection, points without per-sample rows."""
        norm = config.norm
        require(config.kind.name == "gradient_norm" and norm.squared and norm.order == 1
                and norm.projection in ("sum", "orthonormal")
                and config.points not in ("parameters", "activations"),
                "method='perturbation' estimates squared per-sample norms with target 0 (R1, "
                "R2, double backprop, the Jacobian: target=0, power=2, p=2, order=1, per-sample "
                "points other than 'activations'); for other penalties use "
                "method='double_backward' or 'finite_difference'")

    def build(self, config: Configuration, penalty: PenaltyFunctions) -> Method:
        return PerturbationMethod(penalty, DEFAULT_STEP if self.sigma is None else self.sigma,
                                  DEFAULT_COUNT if self.count is None else self.count,
                                  central=self.central)


class PerturbationMethod:
    """The squared norms estimated from perturbed forwards
    (:func:`~gradreg.penalties.methods.perturbation.perturbation_sq_norms`), no double backward; the
    forward at the points themselves is the callable's (a
    :class:`~gradreg.penalties.state.randomness.SharedForward` hands back the task's outputs there
    and the random state their forward began with, which the perturbed forwards replay). Samples
    are checked independent on the first call (coupled samples are refused)."""

    def __init__(self, penalty: PenaltyFunctions, step: float, count: int, *,
                 central: bool) -> None:
        self.penalty = penalty
        self.options = {"step": step, "central": central, "count": count}
        self._checked = False

    def __call__(self, call: PenaltyCall) -> Tensor:
        sq = perturbation_sq_norms(call.forward("the perturbation estimate"), call.inputs,
                                   check_samples=not self._checked,
                                   **self.options)
        self._checked = True  # only once the check has passed
        return self.penalty.of_norms(sq)
