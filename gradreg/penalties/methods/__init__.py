r"""How a penalty's parameter gradient is computed (``double_backward``, ``finite_difference``,
``perturbation``), and the cost levers that keep the method (``subsample``, lazy ``every``).

Notation: per-sample outputs :math:`f_i`, points :math:`x_i`, input gradients
:math:`g_i = \nabla_{x_i} \sum_j f_j`, the unweighted penalty :math:`P(g)` (a function of the
gradients only, built by :class:`~gradreg.penalties.GradientPenalty`), parameters :math:`\theta`.
By the chain rule, with :math:`v_i = \partial P / \partial g_i` held fixed,

.. math::

    \nabla_\theta P = \sum_i H_{\theta x_i} v_i
                    = \nabla_\theta \sum_i \langle \nabla_{x_i} f_i, v_i \rangle ,

a mixed second derivative. ``double_backward`` gets it exactly by differentiating the graph of
:math:`g` (reverse over reverse); ``finite_difference`` returns the exact value
of :math:`P` plus a zero-valued surrogate :math:`S - \operatorname{detach}(S)` whose parameter
gradient is the estimate, so ``(task + penalty).backward()`` works unchanged. Only parameter
gradients are estimated; the gradient the surrogate sends to the points themselves is not
meaningful. ``perturbation`` (squared norms with target 0 only) replaces :math:`P` itself by an
estimate from perturbed forwards (:mod:`~gradreg.penalties.methods.perturbation`), differentiated by
an ordinary first-order backward: value and parameter gradient are :math:`P`'s in expectation.

| method            | work on top of the task step           | error of the parameter gradient   |
|-------------------|----------------------------------------|-----------------------------------|
| double_backward   | input backward with graph + its        | exact                             |
|                   | backward (about 2x a plain step)       |                                   |
| finite_difference | input backward, forward + backward at  | O(step) + O(u/step) when smooth;  |
|                   | shifted points (about 2.3x in FLOPs)   | O(1) piecewise-linear (refused)   |
| perturbation      | a forward at x + σε, first-order       | an estimate: sampling noise       |
|                   | backward only (squared norms, target 0)| (rel. std √2 per probe), O(σ²)    |

``chunks`` keeps double backward (exact) and trades kernel size and two parameter-sized buffers
for the memory of the penalty's graph: it is built and differentiated one micro-batch at a time
(:func:`~gradreg.penalties.methods.chunks.in_chunks`).

Each method is an option object (:data:`METHOD_TYPES`: a frozen dataclass that checks its own
fields, states what it supports in ``check(config)`` and builds, once per penalty, a callable from
one :class:`~gradreg.penalties.call.PenaltyCall` to the unweighted penalty in
``build(config, penalty)``); :data:`METHODS`, the names of the flat option ``method``, are theirs.
Measured ratios are in ``docs/benchmarks.md`` (``scripts/benchmark.py``).

The helpers of the methods live in their own modules:
:mod:`~gradreg.penalties.methods.finite_difference` (the difference, the check of smoothness),
:mod:`~gradreg.penalties.methods.chunks` (micro-batches, subsample) and
:mod:`~gradreg.penalties.methods.surrogate` (a value carrying gradients computed ahead of the
caller's backward); the unit roundoff and the finite-difference step are
:mod:`~gradreg.penalties.guards.precision`'s, the protocol of one call
:mod:`~gradreg.penalties.call`'s.

Floor 4 of ``gradreg.penalties``, beside ``kinds/``: the two do not import each other; both
stand on the protocol of one call (``call``, floor 3).
"""

from __future__ import annotations

from gradreg.penalties.guards.options import Option
from gradreg.penalties.methods.chunks import InChunks, in_chunks, subsample
from gradreg.penalties.methods.double_backward import DoubleBackward, ExactPenalty
from gradreg.penalties.methods.finite_difference import (
    PIECEWISE_LINEAR,
    FiniteDifference,
    ParameterShift,
    check_smooth,
    finite_difference,
)
from gradreg.penalties.methods.param_gradient import ParameterFiniteDifference
from gradreg.penalties.methods.perturbation import Perturbation, perturbation_sq_norms

__all__ = [
    "METHODS",
    "METHOD_TYPES",
    "PIECEWISE_LINEAR",
    "DoubleBackward",
    "ExactPenalty",
    "FiniteDifference",
    "InChunks",
    "ParameterFiniteDifference",
    "ParameterShift",
    "Perturbation",
    "check_smooth",
    "finite_difference",
    "in_chunks",
    "perturbation_sq_norms",
    "subsample",
]


#: The methods, whose names are the values of the flat option ``method``
#: (:class:`ParameterShift` is the form of ``"finite_difference"`` for ``points="parameters"``).
METHOD_TYPES: tuple[type[Option], ...] = (DoubleBackward, FiniteDifference, Perturbation)
METHODS = tuple(method.name for method in METHOD_TYPES)
