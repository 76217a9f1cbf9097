r"""One gradient-penalty mechanism; every published penalty is a configuration of it.

For per-sample outputs :math:`f(x_i)` and the tensors :math:`x_i` they were computed from, the
penalty is

.. math::

    P = \text{weight} \cdot \text{every} \cdot \text{gain} \cdot
        \operatorname{reduce}_i \big( \phi(\lVert g_i \rVert_p - c) \big)^{\text{power}},
    \qquad \phi(t) = \max(0, t) \text{ if one-sided else } |t|,

where :math:`g_i` is the gradient of sample :math:`i` (all its non-batch dimensions, over every
input), :math:`c` the target, and the reduction a mean or a sum over samples. The gradient is that
of the *sum* of the per-sample outputs (a vector-Jacobian product), so for models whose samples do
not interact :math:`g_i = \nabla_{x_i} f(x_i)` and the value does not depend on how a batch is
split into micro-batches or DDP ranks. It is built with ``create_graph=True``: the penalty's
gradient w.r.t. the parameters is the exact double-backward one.

Where :math:`g_i` comes from is a choice of ``projection`` and ``order``:

* ``"sum"`` (order ``n``): :math:`g_i = \partial^n (\sum f)/\partial x_i^n` (``nth_derivative``);
* ``"orthonormal"``: ``num_projections`` orthonormal directions :math:`v_{ij}` drawn uniformly per
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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from gradreg.autograd import (
    GradientError,
    _as_tuple,
    check_double_backward,
    gradient,
    nth_derivative,
)
from gradreg.penalties import methods
from gradreg.penalties.checks import check_per_sample
from gradreg.penalties.finite import FiniteCheck
from gradreg.penalties.norms import per_sample_norm, safe_sqrt

__all__ = ["POINTS", "GradientPenalty", "gradient_penalty", "per_sample_norm"]

POINTS = ("inputs", "real", "fake", "interpolates", "perturbed", "activations", "latents",
          "parameters")
PROJECTIONS = ("sum", "orthonormal", "gaussian")
REDUCTIONS = ("mean", "sum")


def _unscaled_vjp(outputs: Tensor, inputs: tuple[Tensor, ...], grad_outputs: Tensor,
                  loss_scale: float | Tensor | None) -> tuple[Tensor, ...]:
    """``gradient(outputs, inputs, grad_outputs)``; under a loss scale s (fp16 GradScaler) the
    outputs are scaled by s before differentiating and the gradients multiplied by 1/s, PyTorch's
    documented gradient-penalty recipe (never ``scaler.unscale_``)."""
    if loss_scale is None:
        return gradient(outputs, inputs, grad_outputs=grad_outputs)
    scaled = gradient(outputs * loss_scale, inputs, grad_outputs=grad_outputs)
    return tuple(g * (1.0 / loss_scale) for g in scaled)


def _projected_sq_norm(
    outputs: Tensor, inputs: tuple[Tensor, ...], projection: str, num_projections: int,
    loss_scale: float | Tensor | None = None,
) -> Tensor:
    """Squared per-sample norm of J^T v for random v (see the module docstring).

    The random directions are drawn in at least float32 and then cast to the outputs' dtype:
    under bf16/fp16 autocast the draws are those of a float32 run with the same seed (torch's
    generators do not promise the same numbers for a half-precision ``randn``; torch 2.11 gives
    different ones), and the QR of the orthonormal directions is taken in float32.
    """
    batch = outputs.shape[0]
    flat = outputs.reshape(batch, -1)
    k = flat.shape[1]
    draw = {"dtype": torch.promote_types(flat.dtype, torch.float32), "device": flat.device}
    if projection == "gaussian":
        pixels = math.prod(outputs.shape[2:]) if outputs.ndim > 2 else k
        noise = (torch.randn(flat.shape, **draw) / math.sqrt(pixels)).to(flat.dtype)
        return _latent_sq_length(_unscaled_vjp(flat, inputs, noise, loss_scale))
    if num_projections > k:
        raise GradientError(
            f"num_projections={num_projections} exceeds the {k} outputs per sample: "
            f"at most {k} orthonormal directions exist (and {k} gives the exact norm)."
        )
    gaussian = torch.randn(batch, k, num_projections, **draw)
    directions = torch.linalg.qr(gaussian).Q.to(flat.dtype)  # [B, K, n], orthonormal, uniform
    sq = sum(
        per_sample_norm(_unscaled_vjp(flat, inputs, directions[:, :, j], loss_scale), squared=True)
        for j in range(num_projections)
    )
    return sq * (k / num_projections)


def _latent_sq_length(grads: tuple[Tensor, ...]) -> Tensor:
    r"""Per-sample squared length of latent gradients, StyleGAN2's ``pl_lengths ** 2``.

    A latent of shape [B, num_ws, w_dim] (StyleGAN2's W+: one w per synthesis layer) gives
    :math:`\frac{1}{\text{num\_ws}} \sum_{l} \lVert g_{il} \rVert^2`, the mean over the layers
    of the squared norm over ``w_dim`` (``pl_grads.square().sum(2).mean(1)``); [B, w_dim] is
    the same with one layer, i.e. the squared norm. Other shapes take all non-batch dims.
    """
    return sum(g.square().sum(2).mean(1) if g.ndim == 3 else g.flatten(1).square().sum(1)
               for g in grads)


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
    """
    inputs = _as_tuple(inputs)
    check_per_sample(outputs, inputs)
    squared = _squared(target, power, p)
    norms = _norms(outputs, inputs, p=p, squared=squared)
    return _penalty_from_norms(norms, target=target, one_sided=one_sided, power=power,
                               reduction=reduction, squared=squared)


def _squared(target: float | Tensor, power: float, p: float) -> bool:
    return isinstance(target, (int, float)) and target == 0 and power == 2 and p == 2


def _norms(outputs: Tensor, inputs: tuple[Tensor, ...], *, p: float, squared: bool,
           order: int = 1, per_sample: bool = True,
           loss_scale: float | Tensor | None = None) -> Tensor:
    if order == 1:
        grads = _unscaled_vjp(outputs, inputs, torch.ones_like(outputs), loss_scale)
    else:
        scale = 1.0 if loss_scale is None else loss_scale
        grads = tuple(nth_derivative(outputs * scale, x, order) * (1.0 / scale) for x in inputs)
    return per_sample_norm(grads, p, squared=squared, per_sample=per_sample)


def _penalty_from_norms(norms: Tensor, *, target: float | Tensor, one_sided: bool, power: float,
                        reduction: str, squared: bool) -> Tensor:
    if squared:  # target 0, power 2, p 2: the squared norm itself, no root
        values = norms
    else:
        deviation = norms - target
        deviation = deviation.clamp_min(0) if one_sided else deviation.abs()
        values = deviation if power == 1 else deviation.pow(power)
    if reduction == "mean":
        return values.mean()
    if reduction == "sum":
        return values.sum()
    if reduction == "none":
        return values
    raise ValueError(f"unknown reduction {reduction!r}; valid: 'mean', 'sum', 'none'.")


class GradientPenalty(nn.Module):
    r"""A configured gradient penalty; call it as ``penalty(outputs, inputs)``.

    Returns :math:`\text{weight} \cdot \text{every} \cdot \text{gain} \cdot P` with :math:`P` as in
    the module docstring. All parameters are plain values (a Hydra config can set them):

    Args:
        weight: the penalty coefficient (lambda, gamma), >= 0; may be changed between steps.
        target: the norm's target c >= 0 (0 for R1/R2/double backprop, 1 for WGAN-GP), or
            ``"ema"`` for StyleGAN2's running mean of the norms (path length).
        one_sided: penalize only norms above the target (WGAN-LP).
        power: exponent of the deviation, > 0.
        p: the norm's order, > 0.
        reduction: ``"mean"`` or ``"sum"`` over samples.
        every: lazy regularization: compute on one step in ``every`` (see :meth:`due`) and scale by
            ``every`` so the expected gradient is unchanged (StyleGAN2).
        points: what the caller differentiates against (one of :data:`POINTS`); ``"parameters"``
            takes one norm over all parameter gradients instead of per-sample norms.
        of: what the caller differentiates: ``"outputs"`` of the model (critic scores, logits,
            generated images) or the per-sample task ``"loss"`` (double backprop).
        layers: dotted submodule names whose outputs are the points, for ``"activations"``.
        gain: a constant factor of the formula (1/2 for R1/R2's gamma/2).
        order: derivative order n of the ``"sum"`` projection.
        projection: ``"sum"``, ``"orthonormal"`` or ``"gaussian"`` (module docstring).
        num_projections: random directions for ``"orthonormal"``.
        ema_decay: the running mean's decay for ``target="ema"``.
        check_finite: raise :class:`~gradreg.GradientError` when the points, the outputs (when
            passed as a tensor), the penalty or the weighted penalty holds NaN or Inf, instead of
            letting it pass silently (:class:`~gradreg.penalties.finite.FiniteCheck`):
            on the CPU at once, before the value is used; on CUDA without a host sync, at a later
            call (normally the next) that names the call, after that call's optimizer step;
            ``finite_check.settle()`` waits for all. Not under a ``loss_scale``: there a
            non-finite value is the GradScaler's overflow signal, and the scaler skips the step
            and lowers its scale.
        method: how the parameter gradient is computed, one of :data:`methods.METHODS`:
            ``"double_backward"`` (exact), ``"finite_difference"`` (no double backward, error
            O(fd_eps); refused on piecewise-linear models) or ``"compiled"`` (exact, through
            compiled ``torch.func``; falls back to double backward with a warning). The two
            latter need ``outputs`` as a callable; see :mod:`gradreg.penalties.methods`.
        subsample: evaluate on the first ``ceil(subsample * B)`` samples only (StyleGAN2's batch
            shrink; needs ``outputs`` as a callable): unbiased for ``"mean"``, a sum is rescaled.
        chunks: build and differentiate the penalty ``chunks`` micro-batches at a time
            (:func:`methods.in_chunks`): the same gradient, about ``1/chunks`` of the penalty
            graph's peak memory; needs ``outputs`` as a callable, double backward, per-sample
            points and a numeric target.
        fd_eps: the finite-difference step (input-space length of each sample's shift);
            ``None`` picks :func:`methods.default_step` for the precision the model's arithmetic
            ran in (:func:`methods.unit_roundoff`: float64, float32, or TF32 on GPUs).

    State (checkpointed through ``state_dict``): the lazy step counter, the running mean, and the
    current weight. ``last_value`` holds the detached unweighted penalty of the last call.
    """

    def __init__(
        self,
        *,
        weight: float = 1.0,
        target: float | str = 0.0,
        one_sided: bool = False,
        power: float = 2.0,
        p: float = 2.0,
        reduction: str = "mean",
        every: int = 1,
        points: str = "inputs",
        of: str = "outputs",
        layers: Sequence[str] = (),
        gain: float = 1.0,
        order: int = 1,
        projection: str = "sum",
        num_projections: int = 1,
        ema_decay: float = 0.01,
        check_finite: bool = True,
        method: str = "double_backward",
        subsample: float = 1.0,
        fd_eps: float | None = None,
        chunks: int = 1,
    ) -> None:
        super().__init__()
        _require(target == "ema" or (isinstance(target, (int, float)) and target >= 0),
                 f"target must be a number >= 0 or 'ema', got {target!r}")
        _require(power > 0, f"power must be > 0, got {power!r}")
        _require(p > 0, f"p (the norm's order) must be > 0, got {p!r}")
        _require(reduction in REDUCTIONS,
                 f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        _require(isinstance(every, int) and every >= 1,
                 f"every must be an int >= 1 (1 = every step), got {every!r}")
        _require(points in POINTS, f"points must be one of {POINTS}, got {points!r}")
        _require(of in ("outputs", "loss"), f"of must be 'outputs' or 'loss', got {of!r}")
        _require(points != "activations" or len(layers) > 0,
                 "points='activations' needs layers=[...] naming the submodules to penalize")
        _require(projection in PROJECTIONS,
                 f"projection must be one of {PROJECTIONS}, got {projection!r}")
        _require(isinstance(order, int) and order >= 1, f"order must be an int >= 1, got {order!r}")
        _require(order == 1 or projection == "sum", "order > 1 needs projection='sum'")
        _require(isinstance(num_projections, int) and num_projections >= 1,
                 f"num_projections must be an int >= 1, got {num_projections!r}")
        _require(0 < ema_decay <= 1, f"ema_decay must be in (0, 1], got {ema_decay!r}")
        _require(gain > 0, f"gain must be > 0, got {gain!r}")
        _require(method in methods.METHODS,
                 f"method must be one of {methods.METHODS}, got {method!r}")
        _require(method == "double_backward" or (
            projection == "sum" and order == 1 and target != "ema"
            and points not in ("parameters", "activations")),
            f"method={method!r} supports projection='sum', order=1, a numeric target and "
            "per-sample points other than 'activations'; use method='double_backward'")
        _require(0 < subsample <= 1, f"subsample must be in (0, 1], got {subsample!r}")
        _require(fd_eps is None or fd_eps > 0, f"fd_eps must be > 0 or None, got {fd_eps!r}")
        _require(isinstance(chunks, int) and chunks >= 1,
                 f"chunks must be an int >= 1 (1 = the whole batch at once), got {chunks!r}")
        _require(chunks == 1 or (method == "double_backward" and target != "ema"
                                 and points != "parameters"),
                 f"chunks={chunks} needs method='double_backward', a numeric target (an 'ema' "
                 "target couples the samples) and per-sample points; use chunks=1")
        self.weight = weight
        self.target = target
        self.one_sided = one_sided
        self.power = power
        self.p = p
        self.reduction = reduction
        self.every = every
        self.points = points
        self.of = of
        self.layers = tuple(layers)
        self.gain = gain
        self.order = order
        self.projection = projection
        self.num_projections = num_projections
        self.ema_decay = ema_decay
        self.check_finite = check_finite
        self.method = method
        self.subsample = subsample
        self.fd_eps = fd_eps
        self.chunks = chunks
        self._compiled: methods.CompiledPenalty | None = None
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self._steps = 0  # the counter itself; ``step`` mirrors it for checkpoints
        self.register_buffer("ema", torch.zeros(()))
        self.last_value: Tensor | None = None
        self.finite_check = FiniteCheck()
        self._first_call_checked = False

    @property
    def weight(self) -> float:
        return self._weight

    @weight.setter
    def weight(self, value: float) -> None:
        _require(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
                 f"weight must be a finite number >= 0, got {value!r}")
        self._weight = float(value)

    def extra_repr(self) -> str:
        return (f"weight={self.weight}, target={self.target}, points={self.points!r}, "
                f"every={self.every}")

    def get_extra_state(self) -> dict:
        return {"weight": self.weight}

    def set_extra_state(self, state: dict) -> None:
        self.weight = state["weight"]

    @property
    def needs_callable(self) -> bool:
        """Whether :meth:`forward` must be given ``outputs`` as a callable ``fn(*points)``: the
        methods other than double backward, ``subsample`` and ``chunks`` run their own forward."""
        return self.method != "double_backward" or self.subsample < 1 or self.chunks > 1

    @property
    def steps_taken(self) -> int:
        """How many times :meth:`due` was called: the training steps this penalty was considered
        for (due or not), i.e. the steps of the optimizer it belongs to when the module calls
        ``due()`` once per such step. Saved in checkpoints (the ``step`` buffer)."""
        return self._steps

    def due(self) -> bool:
        """Advance the lazy counter one step; True on the steps where the penalty is computed.

        Call once per training step and compute the penalty only when it returns True: on the
        other ``every - 1`` steps nothing is computed, no graph is built. The decision is taken
        on a Python integer (no device sync on a GPU); the ``step`` buffer is written to, not
        read, and a loaded state dict sets the integer again.
        """
        is_due = self._steps % self.every == 0
        self._steps += 1
        self.step.fill_(self._steps)
        return is_due

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object) -> None:
        saved_ema = state_dict.get(prefix + "ema")
        if isinstance(saved_ema, Tensor):  # a float64 running mean is restored in float64
            self._promote_ema(saved_ema.dtype)
        super()._load_from_state_dict(state_dict, prefix, *args)
        self._steps = int(self.step)

    def forward(
        self,
        outputs: Tensor | Callable[..., Tensor],
        inputs: Tensor | Sequence[Tensor],
        *,
        loss_scale: float | Tensor | None = None,
        fn_args: Sequence[Tensor] = (),
    ) -> Tensor:
        """The weighted penalty of ``outputs`` (per sample, batch first) w.r.t. ``inputs``.

        ``loss_scale``: with fp16 autocast and a ``GradScaler``, pass ``scaler.get_scale()``: the
        gradients are taken of ``outputs * scale`` and multiplied by ``1/scale`` (PyTorch's
        gradient-penalty recipe) so that small fp16 gradients do not underflow.

        ``outputs`` may instead be a callable ``fn(*inputs) -> outputs`` (a module, or a closure
        over the labels for a per-sample loss): the penalty then runs the forward itself, which
        ``subsample``, ``chunks`` and the methods other than ``"double_backward"`` need
        (:attr:`needs_callable`). ``fn_args``: further per-sample arguments of the callable,
        batch first and not differentiated (the labels of a per-sample loss), called as
        ``fn(*points, *fn_args)`` and subsampled or split into ``chunks`` with the points.
        """
        inputs, fn_args = _as_tuple(inputs), tuple(fn_args)
        fn = None if isinstance(outputs, Tensor) else outputs
        _require(fn is not None or not fn_args, "fn_args need outputs as a callable")
        _require(fn is not None or not self.needs_callable,
                 f"method={self.method!r}, subsample={self.subsample} and chunks={self.chunks} "
                 "need outputs as a callable fn(*inputs) -> outputs (e.g. the critic itself), "
                 "not a tensor")
        _require(loss_scale is None or self.method == "double_backward",
                 "loss_scale is only supported by method='double_backward'")
        batch = inputs[0].shape[0] if inputs[0].ndim > 0 else 1
        if fn is not None:
            both = methods.subsample(inputs + fn_args, self.subsample)
            inputs, fn_args = both[:len(inputs)], both[len(inputs):]
        value = (None if self.method == "double_backward"
                 else self._approximate(fn, inputs, fn_args))
        if value is None and self.chunks > 1:
            value = methods.in_chunks(
                lambda xs, args: self._exact(fn(*xs, *args), xs, loss_scale), inputs,
                self.chunks, args=fn_args, mean=self.reduction == "mean", loss_scale=loss_scale)
        elif value is None:
            value = self._exact(outputs if fn is None else fn(*inputs, *fn_args), inputs,
                                loss_scale)
        if self.reduction == "sum" and inputs[0].ndim > 0 and inputs[0].shape[0] < batch:
            value = value * (batch / inputs[0].shape[0])
        factor = self.weight * self.every * self.gain
        weighted = value * factor
        self.last_value = value.detach()
        if self.check_finite and loss_scale is None:
            self.finite_check(self.last_value, points=inputs, weighted=weighted, factor=factor,
                              outputs=outputs if fn is None else None)
        return weighted

    def _exact(self, outputs: Tensor, inputs: tuple[Tensor, ...],
               loss_scale: float | Tensor | None) -> Tensor:
        """The unweighted penalty, differentiable by double backward (``create_graph=True``)."""
        if self.points != "parameters":
            check_per_sample(outputs, inputs)
        squared = _squared(self.target, self.power, self.p) and self.target != "ema"
        if self.projection == "sum":
            norms = _norms(outputs, inputs, p=self.p, squared=squared, order=self.order,
                           per_sample=self.points != "parameters", loss_scale=loss_scale)
        else:
            sq = _projected_sq_norm(outputs, inputs, self.projection, self.num_projections,
                                    loss_scale)
            norms = sq if squared else safe_sqrt(sq)
        if not self._first_call_checked:
            check_double_backward(norms)
            if self.subsample < 1 or self.chunks > 1:
                methods.check_independent_samples(
                    norms, f"subsample={self.subsample}, chunks={self.chunks}")
            self._first_call_checked = True
        target = self._ema_target(norms) if self.target == "ema" else self.target
        return _penalty_from_norms(norms, target=target, one_sided=self.one_sided,
                                   power=self.power, reduction=self.reduction, squared=squared)

    def _penalty_of_grads(self, grads: tuple[Tensor, ...]) -> Tensor:
        """The unweighted penalty as a function of the per-sample input gradients alone."""
        squared = _squared(self.target, self.power, self.p)
        return _penalty_from_norms(per_sample_norm(grads, self.p, squared=squared),
                                   target=self.target, one_sided=self.one_sided, power=self.power,
                                   reduction=self.reduction, squared=squared)

    def _approximate(self, fn: Callable[..., Tensor], inputs: tuple[Tensor, ...],
                     fn_args: tuple[Tensor, ...]) -> Tensor | None:
        """The penalty by ``self.method`` (not double backward); None where compile fell back."""
        if self.method == "finite_difference":
            value = methods.finite_difference(lambda *xs: fn(*xs, *fn_args), inputs,
                                              self._penalty_of_grads, eps=self.fd_eps,
                                              check=not self._first_call_checked)
            self._first_call_checked = True  # only once the check has passed
            return value
        if self._compiled is None or self._compiled.module is not fn:
            self._compiled = methods.CompiledPenalty(fn, self._penalty_of_grads)
        return self._compiled(inputs, fn_args)

    def _ema_target(self, norms: Tensor) -> Tensor:
        """StyleGAN2: a <- a + decay * (mean norm - a); the penalty uses the updated a, whose
        current-batch term keeps its gradient exactly as in the reference code.

        The running mean is kept and updated in at least float32 and in the norms' dtype where
        that is wider: a float64 run promotes the buffer to float64 (in place, so optimizers,
        DDP and checkpoints keep the same tensor), a bf16 run does not lose the small updates
        to bf16 rounding.
        """
        self._promote_ema(norms.dtype)
        ema = self.ema.lerp(norms.mean().to(self.ema.dtype), self.ema_decay)
        self.ema.copy_(ema.detach())
        return ema

    def _promote_ema(self, dtype: torch.dtype) -> None:
        """Widen the running mean's buffer to ``dtype`` where that is wider, in place."""
        wider = torch.promote_types(dtype, self.ema.dtype)
        if wider != self.ema.dtype:
            self.ema.data = self.ema.data.to(wider)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message + ".")
