r"""One gradient-penalty mechanism; every published penalty is a configuration of it.

For per-sample outputs :math:`f(x_i)` and the tensors :math:`x_i` they were computed from, the
penalty is

.. math::

    P = \text{weight} \cdot \text{every} \cdot \text{gain} \cdot
        \operatorname{reduce}_i \big( \phi(\lVert g_i \rVert_p - c) \big)^{\text{power}},
    \qquad \phi(t) = \max(0, t) \text{ if one-sided else } |t|,

where :math:`g_i` is the gradient of sample :math:`i` (all its non-batch dimensions, over every
input), :math:`c` the target, and the reduction a mean, a sum or a maximum over samples. The
gradient is that of the *sum* of the per-sample outputs (a vector-Jacobian product), so for models
whose samples do not interact :math:`g_i = \nabla_{x_i} f(x_i)` and a mean or a sum does not
depend on how a batch is split into micro-batches or DDP ranks (a maximum does: it is taken over
the batch at hand). It is built with ``create_graph=True``: the penalty's
gradient w.r.t. the parameters is the exact double-backward one.

Where :math:`g_i` comes from is a choice of ``projection`` and ``order``:

* ``"sum"`` (order ``n``): :math:`g_i = \partial^n (\sum f)/\partial x_i^n` (``nth_derivative``);
* ``"orthonormal"``: ``count`` orthonormal directions :math:`v_{ij}` drawn uniformly per
  sample; :math:`\lVert g_i\rVert^2 = \frac{K}{n}\sum_j \lVert v_{ij}^\top J_i\rVert^2` is an
  unbiased estimate of :math:`\lVert J_i \rVert_F^2` (Hoffman, Roberts & Yaida 2019), exact at
  :math:`n = K`, :math:`K` the number of outputs per sample;
* ``"gaussian"``: :math:`g_i = J_i^\top y_i`, :math:`y_i \sim N(0, I)/\sqrt{\text{pixels}}`
  (StyleGAN2's path length; pixels = H*W for images, the feature count for vectors). For W+
  latents [B, num_ws, w_dim] the squared length is the mean over num_ws of the squared norm
  over w_dim, as in StyleGAN2 and mmagic (not the norm over both, which is num_ws times larger
  squared).

For ``points="parameters"`` there is one norm over all parameters' gradients (no samples).
With ``target="ema"`` the target is StyleGAN2's running mean of the norms.
The per-sample norms are computed by :mod:`gradreg.penalties.formulas.projections`; the options are
one validated, immutable :class:`~gradreg.penalties.config.PenaltyConfig`.

How the parameter gradient is computed is an option object (:mod:`gradreg.penalties.methods`),
built once with the penalty (``config.kind.build``, which for the gradient norm hands over to
``config.method.build``); :meth:`GradientPenalty.forward` checks that the penalty is due, builds
one checked :class:`~gradreg.penalties.call.PenaltyCall` (the points subsampled), calls the built
method once with it, rescales a sum over a subsample to the whole batch and weights the result.
A new method needs no change here (the guide is "Adding a method" in ``docs/architecture.md``).

What is penalized is the penalty's ``kind`` (:mod:`gradreg.penalties.kinds`): the gradient norm
above, the Jacobian's spectral norm in its place, or the Hessian penalty.

A new way of forming :math:`g_i` is an entry of
:data:`~gradreg.penalties.formulas.projections.PROJECTIONS`; a new reduction over samples, an entry
of :data:`~gradreg.penalties.formulas.norms.REDUCE` (the names the
:class:`~gradreg.penalties.formulas.options.Norm` takes are theirs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from gradreg.autograd import GradientError, as_tuple
from gradreg.penalties.call import Gradients, PenaltyCall, PenaltyFunctions, TaskGradient
from gradreg.penalties.config import FLAT, POINTS, RENAMED, PenaltyConfig
from gradreg.penalties.formulas.norms import (
    NormPenalty,
    gradient_norms,
    penalty_from_norms,
    per_sample_norm,
    squared_norm_penalty,
)
from gradreg.penalties.guards.checks import check_outputs, check_points
from gradreg.penalties.guards.finite import FiniteCheck
from gradreg.penalties.guards.options import finite_number, require
from gradreg.penalties.methods import ExactPenalty, subsample
from gradreg.penalties.state.randomness import SharedForward
from gradreg.penalties.state.running_mean import RunningMean

__all__ = ["POINTS", "GradientPenalty", "gradient_penalty", "per_sample_norm"]

#: The lazy counter's buffer (a checkpoint key, ``<name>.lazy_step``), and its key in checkpoints
#: of earlier releases, loaded under the new one.
COUNTER, OLD_COUNTER = "lazy_step", "step"


def gradient_penalty(
    outputs: Tensor,
    inputs: Tensor | Sequence[Tensor],
    *,
    target: float | Tensor = 0.0,
    one_sided: bool = False,
    power: float = 2.0,
    p: float = 2.0,
    reduction: str = "mean",
) -> Tensor:
    r"""Unweighted :math:`\mathrm{reduce}_i\, \phi(\lVert \nabla_{x_i} \sum f \rVert_p - c)^q`.

    ``outputs``: per-sample values, shape [B] or [B, ...] (critic scores, per-sample losses);
    ``inputs``: tensor(s) requiring grad that ``outputs`` was computed from, batch first.
    ``reduction``: ``"mean"``, ``"sum"`` or ``"none"`` (per-sample values, shape [B]); q = power.

    Examples:
        A linear critic :math:`f(x) = w \cdot x` has :math:`g_i = w`, :math:`\lVert w \rVert = 5`:

        >>> import torch
        >>> from gradreg.penalties import gradient_penalty
        >>> w = torch.tensor([3.0, 4.0])
        >>> x = torch.randn(6, 2, requires_grad=True)
        >>> gradient_penalty(x @ w, x)  # mean_i ||w||^2
        tensor(25.)
        >>> gradient_penalty(x @ w, x, target=1.0, reduction="none")  # (||w|| - 1)^2 per sample
        tensor([16., 16., 16., 16., 16., 16.])
    """
    inputs = as_tuple(inputs)
    check_points(inputs)
    check_outputs(outputs, inputs)
    squared = squared_norm_penalty(target, power, p)
    norms = gradient_norms(outputs, inputs, p=p, squared=squared)
    return penalty_from_norms(norms, target=target, one_sided=one_sided, power=power,
                              reduction=reduction, squared=squared)


class GradientPenalty(nn.Module):
    r"""A configured gradient penalty; call it as ``penalty(outputs, inputs)``.

    Returns :math:`\text{weight} \cdot \text{every} \cdot \text{gain} \cdot P` with :math:`P` as in
    the module docstring.

    Args:
        config: what the penalty computes and how, a :class:`~gradreg.penalties.config
            .PenaltyConfig`; or leave it out and pass its options by keyword
            (``GradientPenalty(target=1.0, points="interpolates")``, as presets and Hydra
            configs do). Read them as ``penalty.config.points``; they do not change
            (``penalty.config.replace(...)`` for another penalty).
        weight: the penalty coefficient (lambda, gamma), >= 0; may be changed between steps.

    State (checkpointed through ``state_dict``): the lazy step counter (the buffer
    ``lazy_step``; a checkpoint of an earlier release, which named it ``step``, loads into it),
    the running mean, and the current weight. ``last_value`` holds the detached unweighted
    penalty of the last call.

    Examples:
        WGAN-GP's formula, :math:`10\,\mathrm{mean}_i (\lVert g_i \rVert - 1)^2`, of a critic
        :math:`D(x) = (w \cdot x)^2 / 2` whose gradient is :math:`(w \cdot x)\,w`:

        >>> import torch
        >>> from gradreg.penalties import GradientPenalty, as_points
        >>> w = torch.tensor([3.0, 4.0])
        >>> x = as_points(torch.tensor([[0.2, 0.0], [0.0, 0.1]]))  # w.x = 0.6, 0.4
        >>> gp = GradientPenalty(weight=10.0, target=1.0, points="interpolates")
        >>> penalty = gp((x @ w).square() / 2, x)  # norms 3 and 2: 10 * (2^2 + 1^2) / 2
        >>> round(penalty.item(), 4), gp.config.points
        (25.0, 'interpolates')
        >>> penalty.backward()  # differentiable: the backward runs through the input gradient
    """

    def __init__(self, config: PenaltyConfig | None = None, /, *, weight: float = 1.0,
                 **options: Any) -> None:
        super().__init__()
        self.config = PenaltyConfig.from_options(config, options)
        self.weight = weight
        config = self.config
        self.register_buffer(COUNTER, torch.zeros((), dtype=torch.long))
        self._steps = 0  # the counter itself; ``lazy_step`` mirrors it for checkpoints
        self._due = False  # what the latest due() returned: whether a lazy penalty may be called
        self.register_buffer("ema", torch.zeros(()))
        norm = config.norm
        self._running_mean = RunningMean(self._buffers, "ema", norm.ema_decay)
        self._of_norms = NormPenalty(
            target=0.0 if norm.target == "ema" else norm.target, one_sided=norm.one_sided,
            power=norm.power, p=norm.p, reduction=norm.reduction, squared=norm.squared)
        self._exact = ExactPenalty(config, self._of_norms, self._running_mean)
        self._method = config.kind.build(config, PenaltyFunctions(
            self._exact, self._of_norms.of_gradients, self._of_norms))
        self.last_value: Tensor | None = None
        self.finite_check = FiniteCheck()
        # what each call reads of the configuration, read once here
        self._lazy, self._per_sample = config.every > 1, config.per_sample
        self._needs_callable, self._losses = config.needs_callable, config.of == "loss"
        self._scalable = (config.method.name == "double_backward"
                          and config.kind.name == "gradient_norm")
        self._sum_of_subsample = config.subsample < 1 and norm.reduction == "sum"
        self._gains, self._check_finite = config.every * config.gain, config.check_finite

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # the buffers and submodules
        except AttributeError:
            if name == OLD_COUNTER:
                raise AttributeError(
                    "penalty.step: the lazy counter is penalty.steps_taken (its buffer "
                    "lazy_step); the step size is penalty.config.step") from None
            if name in FLAT:
                raise AttributeError(f"{name!r} is an option of the penalty's configuration: "
                                     f"read penalty.config.{name}") from None
            if name in RENAMED:
                raise AttributeError(f"the option {name!r} was renamed {RENAMED[name]!r}: read "
                                     f"penalty.config.{RENAMED[name]}") from None
            raise

    @property
    def weight(self) -> float:
        return self._weight

    @property
    def factor(self) -> float:
        """What the unweighted penalty is multiplied by: ``weight * every * gain`` (the lazy
        ``every`` standing for the steps it skips, the ``gain`` a formula's constant), so that a
        call returns ``factor * last_value``.

        Examples:
            >>> from gradreg.penalties import r1
            >>> r1(10.0, every=4).factor  # 10 * 4 * gain 0.5 (R1 is gamma/2 ||grad||^2)
            20.0
        """
        return self._weight * self._gains

    @weight.setter
    def weight(self, value: float | Tensor) -> None:
        self._weight = finite_number("weight", value, minimum=0.0)

    def extra_repr(self) -> str:
        config = self.config
        return (f"weight={self.weight}, target={config.target}, points={config.points!r}, "
                f"every={config.every}")

    def get_extra_state(self) -> dict:
        return {"weight": self.weight}

    def set_extra_state(self, state: dict) -> None:
        self.weight = state["weight"]

    @property
    def needs_callable(self) -> bool:
        """Whether :meth:`forward` must be given ``outputs`` as a callable ``fn(*points)``: the
        methods other than double backward, ``subsample``, ``chunks`` and the kinds run their own
        forward (given a :class:`~gradreg.penalties.SharedForward`, they run its callable)."""
        return self._needs_callable

    @property
    def steps_taken(self) -> int:
        """How many times :meth:`due` was called: the training steps this penalty was considered
        for (due or not), i.e. the steps of the optimizer it belongs to when the module calls
        ``due()`` once per such step. Saved in checkpoints (the ``lazy_step`` buffer)."""
        return self._steps

    def due(self) -> bool:
        """Advance the lazy counter one step; True on the steps where the penalty is computed.

        Call once per training step and compute the penalty only when it returns True: on the
        other ``every - 1`` steps nothing is computed, no graph is built. With ``every > 1`` a
        call of the penalty is refused unless the latest ``due()`` returned True (the value is
        scaled by ``every``: computed on every step it would be ``every`` times too large); it
        may be called more than once on a due step (micro-batches). The decision is taken
        on a Python integer (no device sync on a GPU); the ``lazy_step`` buffer is written to, not
        read, and a loaded state dict sets the integer again.

        Examples:
            >>> from gradreg.penalties import r1
            >>> penalty = r1(10.0, every=4)
            >>> [penalty.due() for _ in range(6)]
            [True, False, False, False, True, False]
        """
        is_due = self._steps % self.config.every == 0
        self._steps += 1
        self.lazy_step.fill_(self._steps)
        self._due = is_due
        return is_due

    def _check_due(self) -> None:
        """Refuse a lazy penalty (``every > 1``) called without a ``due()`` that allowed it: it
        is scaled by ``every``, so computed on every step it would be ``every`` times too large
        (and ``every``² times with a loop's own lazy gain on top)."""
        every = self.config.every
        if every > 1 and not self._due:
            raise GradientError(
                f"this penalty has every={every}: its value is multiplied by {every} to stand "
                f"for the {every} steps it skips, on the steps where "
                "penalty.due() returned True. Call due() once per training step and the penalty "
                "only when it is True (`if penalty.due(): loss = loss + penalty(outputs, "
                "points)`), without a gain of your own; or build the penalty with every=1 to "
                "compute it on every step.")

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> GradientPenalty:
        with self._running_mean.kept_wide():  # the running mean stays in float32 or wider
            return super()._apply(fn, recurse)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object) -> None:
        saved_ema = state_dict.get(prefix + "ema")
        if isinstance(saved_ema, Tensor):  # a float64 running mean is restored in float64
            self._running_mean.promote(saved_ema.dtype)
        if prefix + OLD_COUNTER in state_dict and prefix + COUNTER not in state_dict:
            state_dict[prefix + COUNTER] = state_dict.pop(prefix + OLD_COUNTER)  # earlier key
        super()._load_from_state_dict(state_dict, prefix, *args)
        self._steps = int(self.lazy_step)

    def forward(
        self,
        outputs: Tensor | Callable[..., Tensor],
        inputs: Tensor | Sequence[Tensor],
        *,
        loss_scale: float | Tensor | None = None,
        fn_args: Sequence[Tensor] = (),
        task: TaskGradient | None = None,
    ) -> Tensor | tuple[Tensor, Gradients | None]:
        r"""The weighted penalty of ``outputs`` (per sample, batch first) w.r.t. ``inputs``.

        ``outputs`` is what the caller has of the model at the points, and the penalty's method
        decides what to run:

        * a tensor: the per-sample outputs, differentiated as they are (double backward only);
        * a callable ``fn(*inputs, *fn_args) -> outputs`` (a module, or a closure over the
          labels for a per-sample loss): the penalty runs the forward itself, which
          ``subsample``, ``chunks``, the kinds and the methods other than ``"double_backward"``
          need (:attr:`needs_callable`);
        * a :class:`~gradreg.penalties.SharedForward` (the callable, the points, the outputs of
          the caller's forward at them and the random state that forward began with): double
          backward differentiates those outputs; the finite difference and the perturbation
          estimate take them at the points and replay the state at the other points; the rest
          run the callable. One object for every method, so a caller (a training loop, the
          Lightning modules) needs no branch on the method: share the task's forward this way
          and the method takes what it can of it.

        ``fn_args``: further per-sample arguments of the callable, batch first and not
        differentiated (the labels of a per-sample loss), called as ``fn(*points, *fn_args)``
        and subsampled or split into ``chunks`` with the points.

        ``loss_scale``: with fp16 autocast and a ``GradScaler``, pass ``scaler.get_scale()``: the
        gradients are taken of ``outputs * scale`` and multiplied by ``1/scale`` (PyTorch's
        gradient-penalty recipe) so that small fp16 gradients do not underflow.

        ``task``: a :class:`~gradreg.penalties.call.TaskGradient` request (on
        ``points="parameters"``, ``outputs`` a :class:`~gradreg.penalties.LossAt`): the call
        returns ``(weighted penalty, task gradient)``, the gradient of the task loss the method
        took on its way (:math:`g + c\,Hv`, or :math:`g` with ``split``), or None where the
        method takes none (double backward: the value carries its gradient); what
        :func:`~gradreg.penalties.penalized_loss` asks for.
        """
        if self._lazy:
            self._check_due()
        inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
        call = self._call(outputs, inputs, loss_scale, tuple(fn_args), task)
        value, gradient = self._method(call), None
        if isinstance(value, tuple):  # a method that took the task's gradient (task given)
            value, gradient = value
        kept = call.inputs[0]
        if self._sum_of_subsample and kept.ndim > 0 and kept.shape[0] < inputs[0].shape[0]:
            value = value * (inputs[0].shape[0] / kept.shape[0])  # to the whole batch's sum
        weighted = self._weighted(value, call)
        return weighted if task is None else (weighted, gradient)

    def _call(self, outputs: Tensor | Callable[..., Tensor], inputs: tuple[Tensor, ...],
              loss_scale: float | Tensor | None, fn_args: tuple[Tensor, ...],
              task: TaskGradient | None = None) -> PenaltyCall:
        """The call, its points checked, with the points (and ``fn_args``) subsampled and the
        check of its outputs bound to them."""
        if (isinstance(outputs, SharedForward) and not self._needs_callable
                and len(inputs) == 1 and outputs.points is inputs[0]):
            outputs, fn_args = outputs.outputs, ()  # the caller's forward, differentiated as is
        config, fn = self.config, None if isinstance(outputs, Tensor) else outputs
        check_points(inputs, per_sample=self._per_sample)
        if fn is None and (fn_args or self._needs_callable):
            self._refuse_tensor(fn_args)
        if loss_scale is not None and not self._scalable:
            raise ValueError(
                f"loss_scale is only supported by method='double_backward' of the gradient norm "
                f"(got method={config.method.name!r}, kind={config.kind.name!r}): run this "
                "penalty outside fp16 autocast, in float32.")
        if fn is not None and config.subsample < 1:
            both = subsample(inputs + fn_args, config.subsample)
            inputs, fn_args = both[:len(inputs)], both[len(inputs):]
        check = partial(check_outputs, inputs=inputs, per_sample=self._per_sample,
                        losses=self._losses)
        return PenaltyCall(inputs, check, outputs=None if fn else outputs, fn=fn,
                           fn_args=fn_args, loss_scale=loss_scale, task=task)

    def _refuse_tensor(self, fn_args: tuple[Tensor, ...]) -> None:
        """Refuse outputs given as a tensor where the call needs the callable."""
        config = self.config
        require(not fn_args, "fn_args need outputs as a callable")
        require(False, f"method={config.method.name!r}, kind={config.kind.name!r}, subsample="
                       f"{config.subsample} and chunks={config.chunks} need outputs as a "
                       "callable fn(*inputs) -> outputs (e.g. the critic itself, called on the "
                       "points), not a tensor")

    def _weighted(self, value: Tensor, call: PenaltyCall) -> Tensor:
        """weight * every * gain * value; the value kept, and checked finite where asked."""
        factor = self.factor
        weighted = value * factor
        self.last_value = value.detach()
        if self._check_finite and call.loss_scale is None:
            # parameters: a non-finite one makes the loss's gradient, and the value, non-finite
            points = call.inputs if self._per_sample else ()
            self.finite_check(self.last_value, points=points, weighted=weighted,
                              factor=factor, outputs=call.outputs)
        return weighted


class _ConfigOption:
    """A flat option as an attribute of :class:`GradientPenalty`: reading it falls through to
    ``GradientPenalty.__getattr__``'s message, setting it is refused (the configuration does not
    change). A descriptor on the class, so that setting the penalty's own attributes on every
    call checks nothing."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, penalty: object, owner: type | None = None) -> Any:
        if penalty is None:
            return self  # on the class: the descriptor, for introspection
        raise AttributeError(self.name)

    def __set__(self, penalty: object, value: object) -> None:
        raise AttributeError(
            f"{self.name} is part of the penalty's configuration, which does not change: build "
            f"another penalty, GradientPenalty(penalty.config.replace({self.name}=...), "
            "weight=penalty.weight).")


def _guard_options(cls: type) -> None:
    """Each flat option the class does not define becomes a :class:`_ConfigOption` of it."""
    for name in FLAT:
        if not hasattr(cls, name):
            option = _ConfigOption()
            setattr(cls, name, option)
            option.__set_name__(cls, name)


_guard_options(GradientPenalty)
