r"""A penalty of the parameter gradient's norm without a double backward (Zhao, Zhang & Hu 2022).

For a loss :math:`L(\theta)`, :math:`g = \nabla_\theta L`, and the penalty :math:`P(g)` of its
norm (``param_grad_norm``: :math:`P = \lVert g \rVert_2`), the chain rule gives
:math:`\nabla_\theta P = H v` with :math:`H = \nabla^2_\theta L` and :math:`v = \partial P /
\partial g` (for :math:`P = \lVert g\rVert_2`, :math:`v = g / \lVert g \rVert`). The
Hessian-vector product is a forward difference of gradients along :math:`\hat v = v/\lVert v
\rVert`, over a shift of length :math:`h`:

.. math::

    H v \approx \lVert v \rVert\,
        \frac{\nabla L(\theta + h \hat v) - \nabla L(\theta)}{h},
    \qquad \text{error} = \tfrac{h}{2} \lVert v \rVert\, \nabla^3 L[\hat v, \hat v]
                        + O(u \lVert \nabla L \rVert \lVert v \rVert / h),

:math:`u` the unit roundoff. The option ``shift`` sets :math:`h` from ``step``
(:func:`shift_length`):

* ``"normalized"`` (the default): :math:`h = r`, ``step``, a fixed length (Zhao et al.; SAM).
  With weight :math:`\lambda`, :math:`P = \lVert g \rVert` and :math:`\alpha = \lambda / r`,
  the step's gradient :math:`\nabla L + \lambda H \hat g` is the paper's :math:`(1-\alpha)\nabla
  L(\theta) + \alpha \nabla L(\theta + r \hat g)`.
* ``"gradient"``: :math:`h = \epsilon \lVert v \rVert`, :math:`\epsilon` = ``step``: the shift
  is :math:`\epsilon v` (:math:`v` of :math:`P` with its ``gain``) and the quotient
  :math:`(\nabla L(\theta + \epsilon v) - \nabla L(\theta))/\epsilon`. For GR, :math:`P =
  \tfrac12 \lVert g \rVert^2` (``power=2, gain=0.5``, weight :math:`\lambda`), :math:`v = g`
  and the step's gradient is that of gradientregularization_trl (Ackermann et al. 2026):

  .. math::

      g_1 + \frac{\lambda}{\epsilon} \bigl(\nabla L(\theta + \epsilon g_1) - g_1\bigr),
      \qquad g_1 = \nabla L(\theta)

  (their recipe also clips :math:`g_1` and the shifted gradient to norm 10 and leaves the
  embeddings and the output layer unshifted). The shift shrinks with the gradient: less
  truncation than a fixed :math:`r` where :math:`\epsilon\lVert v\rVert < r`, more relative
  rounding. Its default :math:`\epsilon` (``step=None``) is :data:`GRADIENT_SHIFT_FACTOR`
  times the normalized rule's default :math:`r` of the loss's arithmetic (3e-4 in float32):
  measured in float32 against float64 double backward, GR's penalty gradient is 0.60% off on
  the digits MLP (:math:`\lVert g\rVert` = 0.36) and 0.47% on the transformer (3.3), where
  :math:`\epsilon` = 1e-3 leaves 1.6% on the transformer (``docs/parameter_gradients.md``).
  With ``adaptive`` (ASAM, Kwon et al. 2021) :math:`P = \lVert \lvert\theta\rvert
  \odot g\rVert`, so :math:`v = \lvert\theta\rvert^2 \odot g / \lVert \lvert\theta\rvert \odot
  g \rVert` (:math:`\lvert\theta\rvert` held constant), and with weight = step = :math:`\rho`
  the step's gradient is :math:`\nabla L(\theta + \rho v)`, davda54/sam's ``adaptive=True``.

It costs one forward and backward at the shifted parameters, and the backward of :math:`g` at
:math:`\theta` (kept for the caller's backward of the task loss), no double backward: it runs on
fused attention kernels, on compiled models (``torch.compile``; their loss at
:math:`\theta` is computed again rather than shared, as their backward cannot retain its
graph) and on FSDP2-sharded modules inside :func:`gradreg.sharding.penalty_step` (it shifts and
differentiates the unsharded parameters the step holds: each rank's penalty is that of its own
batch's gradient, as for the exact form, and the step reduces the gradients as FSDP does).
Where :math:`L` is piecewise linear (ReLU), :math:`H` is zero almost everywhere and the
difference measures the kinks crossed within :math:`h`, as in the paper; the exact form
(``method="double_backward"``) gives :math:`H v` without them.

The forward at the shifted parameters is one of the same function: it draws the random numbers
of the forward at :math:`\theta` (dropout's mask: the state that forward began with,
:attr:`LossAt.state`, replayed by :class:`~gradreg.penalties.state.randomness.Replaying`; a loss
given without its state is refused once the shifted forward turns out to draw), and it leaves the
modules' buffers as the forward at :math:`\theta` left them (BatchNorm's running statistics
updated once per step, :class:`~gradreg.penalties.state.buffers.KeptBuffers`). Frozen parameters are
refused (there is no gradient of theirs to penalize): pass the trainable ones.

The parameters are shifted in place (their ``.data``, so that the autograd graph of the loss at
:math:`\theta` stays valid) and restored bitwise from a copy, also on an error.

Cost. In the form ``loss + penalty(LossAt(fn, loss), params)`` the penalty takes :math:`g` at
:math:`\theta` keeping the loss's graph, and the caller's backward of ``loss`` takes it again:
three backward passes. :func:`~gradreg.penalties.two_pass.penalized_loss` hands the penalty's
:math:`g` to the caller instead (the loss's graph freed), which is the paper's two passes.
"""


from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gradreg.autograd import GradientError
from gradreg.penalties.formulas.norms import per_sample_norm
from gradreg.penalties.guards.compiled import runs_compiled
from gradreg.penalties.guards.precision import default_step, unit_roundoff
from gradreg.penalties.guards.smoothness import piecewise_linear_ops
from gradreg.penalties.methods.surrogate import with_gradients
from gradreg.penalties.state.buffers import KeptBuffers
from gradreg.penalties.state.randomness import GeneratorState, UnreplayedDraws
from gradreg.sharding import held_unsharded

if TYPE_CHECKING:
    from gradreg.penalties.call import Configuration, Gradients, PenaltyCall, PenaltyFunctions

__all__ = ["GRADIENT_SHIFT_FACTOR", "LossAt", "ParameterFiniteDifference", "adaptive_norm_terms",
           "check_default_step_is_smooth", "difference_quotient", "in_dtypes", "parameter_step",
           "shift_length", "shifted_parameters", "trainable", "without_unused"]

WHAT = "param_grad_norm by method='finite_difference'"
#: The default ε of ``shift="gradient"`` (the shift :math:`\epsilon v`, :math:`\lVert \epsilon
#: v\rVert` long) as a fraction of the default length :math:`r` of ``shift="normalized"`` for
#: the same arithmetic (:data:`~gradreg.penalties.guards.precision.PARAMETER_STEPS`): 3e-4 in
#: float32, below 1% error on the digits MLP and on the transformer (module docstring).
GRADIENT_SHIFT_FACTOR = 0.3


class LossAt:
    """The loss as a function of the parameters' current values, for a penalty on
    ``points="parameters"`` by ``method="finite_difference"``: ``fn()`` computes it (called at
    the shifted parameters); ``loss``, where given, is its value already computed at the
    parameters as they are (the task loss: its forward is shared, not run again); ``state``, the
    random state that forward began with (:meth:`GeneratorState.capture
    <gradreg.penalties.state.randomness.GeneratorState.capture>` of the batch, just before it),
    which the shifted forward replays (dropout draws the same mask). :meth:`run` captures the state
    and computes the loss::

        at = LossAt.run(lambda: F.cross_entropy(model(x), y), x)
        total = at.loss + penalty(at, params)

    A ``loss`` given without its ``state`` is refused where the shifted forward draws random
    numbers (its masks could not be the loss's).

    Examples:
        The penalty 0.1 ||dL/dθ|| of a linear model's loss, its value exact (the finite
        difference estimates only its parameter gradient):

        >>> import torch
        >>> from gradreg.penalties import LossAt, param_grad_norm
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Linear(3, 1).double()
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
        >>> params = list(model.parameters())
        >>> def loss(rows=slice(None)):
        ...     return torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        >>> norm = torch.cat([g.flatten() for g in torch.autograd.grad(loss(), params)]).norm()
        >>> at = LossAt.run(loss, x)
        >>> penalty = param_grad_norm(0.1, method="finite_difference")(at, params)
        >>> round(penalty.item(), 6) == round(0.1 * norm.item(), 6), round(at.loss.item(), 4)
        (True, 0.7568)
        >>> (at.loss + penalty).backward()
    """

    def __init__(self, fn: Callable[[], Tensor], loss: Tensor | None = None,
                 state: GeneratorState | None = None) -> None:
        self.fn, self.loss, self.state = fn, loss, state
        #: whether a two-pass call differentiated ``loss`` and freed its graph
        self.spent = False

    @classmethod
    def run(cls, fn: Callable[[], Tensor], *on: Tensor) -> LossAt:
        """Capture the random state of the CPU and of the devices of ``on`` (the batch), then
        compute the loss ``fn()``."""
        state = GeneratorState.capture(*on)
        return cls(fn, fn(), state)

    def __call__(self) -> Tensor:
        return self.fn()


def trainable(params: Sequence[Tensor], what: str) -> tuple[Tensor, ...]:
    """``params``, refused with a :class:`~gradreg.GradientError` where one is frozen (it has
    no gradient to penalize)."""
    frozen = [i for i, p in enumerate(params) if not p.requires_grad]
    if frozen:
        raise GradientError(
            f"{what}: parameters {frozen[:5]}{' ...' if len(frozen) > 5 else ''} of the "
            f"{len(params)} given are frozen (requires_grad=False), so they have no gradient to "
            "penalize: pass the trainable ones, [p for p in model.parameters() if "
            "p.requires_grad].")
    return tuple(params)


def shift_length(shift: str, step: float, length: Tensor, gain: float
                 ) -> tuple[Tensor, Tensor]:
    r"""The length :math:`h` of the shift along :math:`\hat v` (module docstring) and the
    difference quotient's factor :math:`\lVert v \rVert / h` (:math:`H v \approx` factor
    times the difference of gradients), ``length`` :math:`\lVert v \rVert` without the
    ``gain``: ``"normalized"``, :math:`h` = ``step`` (0 where :math:`v = 0`: no shift);
    ``"gradient"``, :math:`h` = ``step`` times ``gain`` times ``length``, the factor
    :math:`1/(\epsilon\,\mathrm{gain})` (0 where :math:`v = 0`: a difference of two
    gradients at the same point, which a nondeterministic kernel need not make 0, is not
    amplified). No host sync."""
    moving = (length > 0).to(length.dtype)
    if shift == "gradient":
        return length * (step * gain), moving / (step * gain)
    return moving * step, length / step


def parameter_step(step: float | None, shift: str, roundoff: float) -> float:
    """``step``, or where None the default for a parameter shift by the rule ``shift`` in
    arithmetic of unit roundoff ``roundoff``: the
    :func:`~gradreg.penalties.guards.precision.default_step` of a parameter shift, times
    :data:`GRADIENT_SHIFT_FACTOR` for ``"gradient"``."""
    if step is not None:
        return step
    return default_step(roundoff, parameters=True) * (
        GRADIENT_SHIFT_FACTOR if shift == "gradient" else 1.0)


@contextmanager
def shifted_parameters(params: Sequence[Tensor], vectors: Sequence[Tensor],
                       amounts: list[Tensor] | float) -> Iterator[None]:
    r"""The block runs at :math:`\theta_j + a_j d_j` (``amounts`` :math:`a_j`, 0-dim tensors in
    each parameter's dtype, or one number for all: :func:`in_dtypes`; ``vectors`` :math:`d_j`);
    the parameters are put back bitwise after it. Written through ``.data``, so the parameters'
    versions do not move and a graph that saved them (the loss at :math:`\theta`) stays valid;
    as list operations
    (``torch._foreach_*``), each tensor's own kernel as a loop would run, one Python call for
    all the parameters.

    Inside ``torch.autocast`` the cast copies of the parameters that autocast keeps for the
    whole block (its weight cache, keyed by the tensor, blind to a change of ``.data``) are
    dropped on entry and on exit: the block's forward casts the shifted values, and a forward
    after it the restored ones (kept, they would run the shifted pass at :math:`\theta`)."""
    data = [p.data for p in params]
    saved = [d.clone() for d in data]
    torch.clear_autocast_cache()
    try:
        if isinstance(amounts, list):
            torch._foreach_addcmul_(data, list(vectors), amounts)
        else:
            torch._foreach_add_(data, list(vectors), alpha=amounts)
        yield
    finally:
        torch._foreach_copy_(data, saved)
        torch.clear_autocast_cache()


def difference_quotient(shifted: list[Tensor], g: Sequence[Tensor], scale: Tensor | float
                        ) -> list[Tensor]:
    r"""``(shifted - g) * scale``, in ``shifted``'s memory: the difference of the gradients at the
    shifted parameters and at :math:`\theta`, times the quotient's factor."""
    torch._foreach_sub_(shifted, list(g))
    torch._foreach_mul_(shifted, in_dtypes(scale, g))
    return shifted


def adaptive_norm_terms(g: Sequence[Tensor], params: Sequence[Tensor]) -> list[Tensor]:
    r""":math:`\lvert\theta\rvert \odot g` per parameter (ASAM's norm is of these), the
    parameters' magnitudes detached: held constant in :math:`v = \partial P/\partial g`."""
    return [t * p.detach().abs() for t, p in zip(g, params, strict=True)]


def in_dtypes(number: Tensor | float, tensors: Sequence[Tensor]) -> list[Tensor] | float:
    """``number`` in the dtype of each of ``tensors`` (converted once per dtype), for a list
    operation over them; a Python number as it is (the operation takes one for all)."""
    if not isinstance(number, Tensor):
        return number
    converted: dict[torch.dtype, Tensor] = {}
    for t in tensors:
        if t.dtype not in converted:
            converted[t.dtype] = number.to(t.dtype)
    return [converted[t.dtype] for t in tensors]


def _gradient(loss: Tensor, params: tuple[Tensor, ...], *, retain: bool) -> list[Tensor]:
    """The gradient of ``loss`` w.r.t. ``params``, zeros for a parameter it does not use."""
    return _gradient_and_unused(loss, params, retain=retain)[0]


def _gradient_and_unused(loss: Tensor, params: tuple[Tensor, ...], *, retain: bool
                         ) -> tuple[list[Tensor], frozenset[int]]:
    """:func:`_gradient` and the indices of the parameters ``loss`` does not use (whose
    ``.grad`` a backward leaves untouched: None where it was)."""
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    unused = frozenset(j for j, g in enumerate(grads) if g is None)
    return ([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)],
            unused)


def without_unused(gradients: list[Tensor], unused: frozenset[int]) -> list[Tensor | None]:
    """``gradients`` with None at the ``unused`` parameters: what a backward hands them (an
    optimizer then leaves them alone, as it leaves a parameter whose ``.grad`` is None)."""
    if not unused:
        return gradients
    return [None if j in unused else t for j, t in enumerate(gradients)]


def _loss_at_theta(fn: Callable[[], Tensor], loss: Tensor | None, state: GeneratorState | None,
                   params: tuple[Tensor, ...]) -> tuple[Tensor, GeneratorState, bool]:
    r"""The loss at :math:`\theta`, the random state its forward began with, and whether that
    state is known to be its (a loss given without one: the state now, checked later)."""
    if loss is not None:
        return (loss, state, True) if state is not None else (
            loss, GeneratorState.capture(*params), False)
    if state is not None:  # computed again (a compiled model): with the task's draws
        with state.replayed():
            return fn(), state, True
    state = GeneratorState.capture(*params)
    return fn(), state, True


def _shifted_gradient(fn: Callable[[], Tensor], state: GeneratorState, known: bool,
                      params: tuple[Tensor, ...], buffers: KeptBuffers, *,
                      watch: bool = False) -> list[Tensor]:
    r"""The gradient of the loss at the shifted parameters, its forward drawing the random
    numbers of the forward at :math:`\theta`, the modules' buffers left as that forward left
    them (put back after the backward, which may read them: BatchNorm's running statistics).
    With ``watch``, a forward that draws from a source no captured state replays (a
    ``torch.Generator`` of its own, Python's ``random``, NumPy's) is refused
    (:class:`UnreplayedDraws`: once per penalty, as the watch takes every torch call through
    Python)."""
    with buffers.kept(params):
        with state.replayed():
            with UnreplayedDraws() if watch else nullcontext() as unreplayed:
                loss = fn()
            if unreplayed is not None and unreplayed.drawn:
                raise GradientError(
                    f"{WHAT} runs the model again at the shifted parameters, and its forward "
                    f"draws from {', '.join(sorted(set(unreplayed.drawn)))}, which no captured "
                    "state replays: the shifted forward draws other numbers and the difference "
                    "would measure the change of draws. Draw from torch's global generator "
                    "(torch.rand without generator=, dropout; seeded by torch.manual_seed), or "
                    "penalize by method='double_backward' (one forward).")
            if not known and state.moved():
                raise GradientError(
                    f"{WHAT} runs the model again at the shifted parameters, and the model "
                    "draws random numbers (dropout in training mode), but the loss at the "
                    "parameters was given without the random state its forward began with: the "
                    "shifted forward could not draw the same masks. Compute it as "
                    "LossAt.run(loss_fn, x) (or pass LossAt(loss_fn, loss, "
                    "GeneratorState.capture(x)) with the state captured before the forward), or "
                    "leave the loss out to let the penalty compute it.")
        return _gradient(loss, params, retain=False)


def check_default_step_is_smooth(loss: Tensor, step: float | None, shift: str,
                                 adaptive: bool) -> None:
    r"""For the default step (``step`` None) of the normalized shift (not ``adaptive``: GNP
    standing in for the exact gradient, not a shift defined by its own length, as SAM's, ASAM's
    or GR's), raise where the graph of ``loss`` holds a piecewise-linear op (ReLU...): there
    :math:`H` is zero almost everywhere and the default-step difference of gradients measures the
    kinks crossed within the shift, not :math:`H v` (a 2-layer ReLU transformer encoder in
    float32: 13.7% from the exact gradient at the default step, 0.018% at 1e-4), so the default
    step does not stand in for the exact gradient; a step given is the objective chosen (the
    difference over that shift, as in Zhao et al.)."""
    if step is not None or shift != "normalized" or adaptive:
        return
    ops = piecewise_linear_ops(loss)
    if ops:
        raise GradientError(
            f"{WHAT} at its default step on a piecewise-linear model ({', '.join(ops)} in its "
            "graph): the difference of gradients measures the kinks crossed within the shift, "
            "not the exact gradient (13.7% off on a ReLU transformer encoder). Use "
            "method='double_backward' (exact), or give step= to penalize the difference over "
            "that shift (Zhao et al.'s objective), or a smooth activation (gelu, silu, tanh).")


class ParameterFiniteDifference:
    """The method (module docstring) of the penalty ``penalty`` configured by ``config``: value
    :math:`P(g)` exact, its parameter gradient :math:`H v` by a difference of gradients over a
    shift of the rule ``shift`` with ``step``, of the adaptive norm where ``adaptive``
    (:class:`~gradreg.penalties.methods.finite_difference.ParameterShift`)."""

    def __init__(self, penalty: PenaltyFunctions, config: Configuration, *, step: float | None,
                 shift: str, adaptive: bool) -> None:
        norm = config.norm
        self.penalty, self.step, self.p, self.squared = penalty, step, norm.p, norm.squared
        self.shift, self.gain, self.adaptive = shift, config.gain, adaptive
        # P(n) = n (target 0, power 1): P'(n) = 1
        self.linear = norm.target == 0 and norm.power == 1 and not norm.squared
        self._shares: bool | None = None  # whether the loss given at θ is used (first call)
        # whether the first call's checks ran: the default step on a smooth loss, the shifted
        # forward watched for generators of its own
        self._checked = False
        self._buffers = KeptBuffers(WHAT)

    def __call__(self, call: PenaltyCall) -> Tensor | tuple[Tensor, Gradients]:
        r"""The unweighted penalty, carrying its parameter gradient; for a call with a
        :class:`~gradreg.penalties.call.TaskGradient` request, ``(value, the task loss's
        gradient)``: :math:`g + c\,Hv` (the value detached), or :math:`g` with ``split`` (the
        value carrying :math:`Hv`)."""
        # FSDP2-sharded parameters: the unsharded ones penalty_step holds (their gradients are
        # reduced when the step ends)
        params = trainable(held_unsharded(call.inputs, WHAT), WHAT)
        given = getattr(call.fn, "loss", None)
        task = call.task
        if task is not None and params is not call.inputs and any(
                a is not b for a, b in zip(params, call.inputs, strict=True)):
            raise GradientError(f"{WHAT} on FSDP2-sharded parameters takes the task loss's "
                                "gradient separately: use loss + penalty(LossAt(fn, loss), "
                                "params) inside gradreg.sharding.penalty_step.")
        if given is not None and self._shares is None:
            # a compiled region's backward donates its buffers (no retain_graph): its loss is
            # computed again instead of shared
            self._shares = not runs_compiled(given)
        shared = given if self._shares else None
        fn = getattr(call.fn, "fn", call.fn)
        loss, state, known = _loss_at_theta(fn, shared, getattr(call.fn, "state", None), params)
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            raise GradientError(
                f"{WHAT} needs the loss as a callable returning a scalar (the mean loss) at the "
                "parameters' current values, e.g. penalty(LossAt(lambda: loss_fn(model(x), y)), "
                f"params); got {type(loss).__name__}"
                f"{'' if not isinstance(loss, Tensor) else list(loss.shape)}")
        if not self._checked:
            check_default_step_is_smooth(loss, self.step, self.shift, self.adaptive)
        retain = shared is not None and (task is None or task.retain_graph)
        g, unused = _gradient_and_unused(loss, params, retain=retain)
        value, vectors, amount, scale = self._shift(g, params, loss)
        watch = not (self._checked or runs_compiled(loss))
        with shifted_parameters(params, vectors, in_dtypes(amount, vectors)):  # θ + h v̂
            shifted = _shifted_gradient(fn, state, known, params, self._buffers, watch=watch)
        self._checked = True
        if task is None or task.split:
            taken = None if task is None else without_unused(list(g), unused)
            used = [j for j in range(len(params)) if j not in unused]  # .grad None stays None
            quotient = difference_quotient(shifted, g, scale)
            value = with_gradients(value, [params[j] for j in used], [quotient[j] for j in used])
            return value if taken is None else (value, taken)
        factor = scale * task.factor  # g + c H v = g + factor (g' - g), in g's memory
        torch._foreach_lerp_(g, shifted, in_dtypes(factor, g))
        return value.detach(), without_unused(g, unused)

    def _shift(self, g: list[Tensor], params: tuple[Tensor, ...], loss: Tensor
               ) -> tuple[Tensor, list[Tensor], Tensor | float, Tensor | float]:
        r"""The penalty :math:`P(g)`, the shift :math:`h \hat v = a\,d` as vectors :math:`d_j`
        and an amount :math:`a` (a scalar), and the difference quotient's factor
        :math:`\lVert v \rVert / h` (:func:`shift_length`); in closed form for the 2-norm and
        its square (:meth:`_of_the_norm`)."""
        step = self.step if self.step is not None else parameter_step(
            None, self.shift, unit_roundoff(loss))
        if (self.p == 2 and (self.linear or self.squared)
                and (not self.adaptive or self.shift == "gradient")):
            return self._of_the_norm(g, params, step)
        value, length, vectors, coefficient = self._direction(g, params)
        shift, scale = shift_length(self.shift, step, length, self.gain)
        return value, vectors, coefficient * shift, scale

    def _of_the_norm(self, g: list[Tensor], params: tuple[Tensor, ...], step: float
                     ) -> tuple[Tensor, list[Tensor], Tensor | float, Tensor | float]:
        r""":meth:`_shift` for :math:`P = n` (``param_grad_norm``, ``sam``, ``asam``: target 0,
        power 1) and :math:`P = n^2` (``gr``'s before its gain: the squared norm) of
        :math:`n = \lVert t \rVert`, :math:`t = g` (``adaptive``, ASAM's: :math:`t =
        \lvert\theta\rvert \odot g`), without the penalty function (of one norm it is the
        identity): :math:`v = c\,d` with :math:`d = g` (ASAM's: :math:`\lvert\theta\rvert \odot
        t`) and :math:`c = 1/n` or 2. Shifted by ``"gradient"``, :math:`h \hat v = \epsilon\,
        \mathrm{gain}\, v`: :math:`a = \epsilon\, \mathrm{gain}\, c` and the factor
        :math:`1/(\epsilon\,\mathrm{gain})`; by ``"normalized"`` (not adaptive, so
        :math:`\lVert v \rVert = c\,n`), :math:`h \hat v = r\, g / n`: :math:`a = r / n` and the
        factor :math:`c\,n / r`; :math:`a` = 0 and the factor 0 where :math:`n = 0` (no
        shift). On the CPU, where reading :math:`n` stalls no stream, :math:`a` and the factor
        are Python numbers (no 0-dim operations)."""
        magnitudes = torch._foreach_abs([p.detach() for p in params]) if self.adaptive else None
        t = torch._foreach_mul(g, magnitudes) if self.adaptive else g
        norms = torch.stack(torch._foreach_norm(t))
        value = torch.dot(norms, norms) if self.squared else torch.linalg.vector_norm(norms)
        d = torch._foreach_mul(t, magnitudes) if self.adaptive else g
        by_gradient = self.shift == "gradient"
        if value.device.type == "cpu":
            n = math.sqrt(value.item()) if self.squared else value.item()
            if not n > 0:  # g = 0, or NaN (the value is checked): no shift
                return value, d, 0.0, 0.0
            c = 2.0 if self.squared else 1 / n
            if by_gradient:
                return value, d, step * self.gain * c, 1 / (step * self.gain)
            return value, d, step / n, c * n / step
        norm = value.sqrt() if self.squared else value
        moving = norm > 0  # at g = 0 the direction is the subgradient 0 (no shift)
        inverse = torch.where(moving, norm, math.inf).reciprocal_()  # 1/n, 0 where n = 0
        if by_gradient:  # squared: a = 2 eps gain, d = 0 where n = 0
            amount = 2.0 * step * self.gain if self.squared else inverse.mul_(step * self.gain)
            return value, d, amount, moving.to(norm.dtype).div_(step * self.gain)
        return value, d, inverse.mul_(step), (
            norm * (2.0 / step) if self.squared else moving.to(norm.dtype).div_(step))

    def _direction(self, g: list[Tensor], params: tuple[Tensor, ...]
                   ) -> tuple[Tensor, Tensor, list[Tensor], Tensor]:
        r"""The penalty :math:`P(g)`, the length :math:`\lVert v \rVert` of :math:`v = \partial
        P/\partial g` and the unit direction :math:`\hat v` as a list of tensors and a scalar
        factor (:math:`\hat v_j = g_j / \lVert g \rVert` for the 2-norm, :math:`v_j /
        \lVert v \rVert` otherwise; 0 where :math:`v = 0`). For
        the 2-norm, :math:`P` is a function of :math:`n = \lVert g \rVert` alone, so
        :math:`v = P'(n)\, g / n` is along :math:`g` (no parameter-sized tensor besides
        :math:`g`; one scalar derivative; the norm and its square, :meth:`_of_the_norm`, need
        none); other norms and ASAM's (``adaptive``: of :math:`\lvert\theta\rvert \odot g`)
        differentiate :math:`P` w.r.t. each :math:`g_j`."""
        if self.p == 2 and not self.adaptive:  # P(n), n = ‖g‖: v = P'(n) g / n
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(g)))
            moving = norm > 0  # at g = 0 the direction is the subgradient 0 (no shift)
            leaf = norm.requires_grad_()
            with torch.enable_grad():
                value = self.penalty.of_norms(leaf)
                (slope,) = torch.autograd.grad(value, leaf)
            length = torch.where(moving, slope.abs(), 0.0)
            coefficient = torch.where(moving, torch.sign(slope) / torch.where(moving, norm, 1.0),
                                      0.0)
            return value, length, g, coefficient
        leaves = [t.detach().requires_grad_() for t in g]
        with torch.enable_grad():
            terms = adaptive_norm_terms(leaves, params) if self.adaptive else leaves
            value = self.penalty.of_norms(per_sample_norm(terms, self.p, squared=self.squared,
                                                          per_sample=False))
            v = torch.autograd.grad(value, leaves, allow_unused=True)
        v = [torch.zeros_like(t) if d is None else d for t, d in zip(leaves, v, strict=True)]
        length = torch.sqrt(sum(d.square().sum() for d in v))
        return value, length, v, torch.where(length > 0, 1 / length, 0.0)
