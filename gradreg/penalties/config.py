"""The configuration of a :class:`~gradreg.penalties.GradientPenalty`: one validated value.

Every option is a plain value (a Hydra config or a preset sets them by keyword); a bad value or
a combination the mechanism cannot compute is refused here, at construction, with the fix. The
weight is not part of it: it may change between steps (schedules) and is checkpointed with the
penalty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradreg.autograd import GradientError
from gradreg.penalties.guards.options import (
    check_count,
    check_hessian_options,
    check_iterations,
    check_kind_method,
    check_step,
    finite_number,
    require,
)

__all__ = ["KINDS", "METHODS", "POINTS", "PROJECTION_NAMES", "REDUCTIONS", "RENAMED", "SHIFTS",
           "PenaltyConfig", "check_method_name", "check_renamed", "squared_norm_penalty"]

#: The options that are real numbers (``p`` may also be ``inf``: the max-norm), converted to
#: ``float`` at construction; ``target`` also takes ``"ema"``, ``step`` also ``None``.
NUMBERS = ("target", "power", "p", "gain", "ema_decay", "subsample", "step")
#: The options that are flags.
FLAGS = ("one_sided", "check_finite", "central", "adaptive")

POINTS = ("inputs", "real", "fake", "interpolates", "perturbed", "activations", "latents",
          "parameters")
REDUCTIONS = ("mean", "sum", "max")
#: How the parameter gradient is computed (:mod:`gradreg.penalties.methods` builds each).
METHODS = ("double_backward", "finite_difference", "perturbation")
#: Where the per-sample gradient comes from (:mod:`gradreg.penalties.formulas.projections`).
PROJECTION_NAMES = ("sum", "orthonormal", "gaussian")
#: Options of earlier releases and the one that replaced each: a step size is ``step``, a
#: number of directions (projections, probes, Rademacher directions) is ``count``.
RENAMED = {"fd_eps": "step", "sigma": "step", "epsilon": "step", "num_projections": "count",
           "probes": "count", "k": "count"}
#: How far a parameter-gradient penalty by finite difference shifts the parameters along the
#: direction :math:`v = \partial P/\partial g` (:mod:`gradreg.penalties.methods.param_gradient`): a
#: fixed length ``step`` (``"normalized"``), or ``step`` times :math:`v` (``"gradient"``).
SHIFTS = ("normalized", "gradient")
#: What is penalized (:mod:`gradreg.penalties.kinds`): the gradient norm of the module docstring
#: of :mod:`gradreg.penalties.mechanism`, the Jacobian's spectral norm, or the Hessian penalty.
KINDS = ("gradient_norm", "spectral", "hessian")


@dataclass(frozen=True)
class PenaltyConfig:
    r"""What a penalty computes and how (the formula is in :mod:`gradreg.penalties.mechanism`).

    Attributes:
        target: the norm's target c >= 0 (0 for R1/R2/double backprop, 1 for WGAN-GP), or
            ``"ema"`` for StyleGAN2's running mean of the norms (path length).
        one_sided: penalize only norms above the target (WGAN-LP).
        power: exponent of the deviation, > 0.
        p: the norm's order, > 0.
        reduction: ``"mean"``, ``"sum"`` or ``"max"`` over samples (``"max"``: Max-GP, the
            largest per-sample value; it does not split over micro-batches or DDP ranks).
        every: lazy regularization: compute on one step in ``every`` (see
            :meth:`GradientPenalty.due <gradreg.penalties.GradientPenalty.due>`) and scale by
            ``every`` so the expected gradient is unchanged (StyleGAN2).
        points: what the caller differentiates against (one of :data:`POINTS`); ``"parameters"``
            takes one norm over all parameter gradients instead of per-sample norms.
        of: what the caller differentiates: ``"outputs"`` of the model (critic scores, logits,
            generated images) or the per-sample task ``"loss"`` (double backprop).
        layers: dotted submodule names whose outputs are the points, for ``"activations"``.
        gain: a constant factor of the formula (1/2 for R1/R2's gamma/2).
        order: derivative order n of the ``"sum"`` projection.
        projection: ``"sum"``, ``"orthonormal"`` or ``"gaussian"``
            (:mod:`gradreg.penalties.formulas.projections`).
        ema_decay: the running mean's decay for ``target="ema"``.
        check_finite: raise :class:`~gradreg.GradientError` when the points, the outputs (when
            passed as a tensor), the penalty or the weighted penalty holds NaN or Inf, instead of
            letting it pass silently (:class:`~gradreg.penalties.guards.finite.FiniteCheck`):
            on the CPU at once, before the value is used; on CUDA without a host sync, at a later
            call (normally the next) that names the call, after that call's optimizer step;
            ``finite_check.settle()`` waits for all. Not under a ``loss_scale``: there a
            non-finite value is the GradScaler's overflow signal, and the scaler skips the step
            and lowers its scale.
        method: how the parameter gradient is computed, one of :data:`METHODS`:
            ``"double_backward"`` (exact),
            ``"finite_difference"`` (no double backward, error O(step); refused on
            piecewise-linear models) or ``"perturbation"`` (squared norms with target 0 from
            perturbed forwards). The two latter need ``outputs`` as a callable; see
            :mod:`gradreg.penalties.methods`.
        subsample: evaluate on the first ``max(2, ceil(subsample * B))`` samples only
            (StyleGAN2's batch shrink; two at least, so that coupled samples show; needs
            ``outputs`` as a callable): unbiased for ``"mean"``, a sum is rescaled.
        chunks: build and differentiate the penalty ``chunks`` micro-batches at a time
            (:func:`~gradreg.penalties.methods.chunks.in_chunks`): the same gradient, about
            ``1/chunks`` of the penalty graph's peak memory; needs ``outputs`` as a callable,
            double backward, per-sample points and a numeric target.
        step: the step size of the estimate that takes one, ``None`` for its default:
            ``method="finite_difference"``, the input-space length of each sample's shift (for
            ``points="parameters"``, the parameter-space length :math:`r` of the shift,
            :mod:`~gradreg.penalties.methods.param_gradient`), by default
            :func:`~gradreg.penalties.guards.precision.default_step` for the precision the model's
            arithmetic ran in (:func:`~gradreg.penalties.guards.precision.unit_roundoff`: float64,
            float32, or TF32 on GPUs); ``method="perturbation"``, the probe's scale σ per
            element (default 0.01); ``kind="hessian"`` by finite difference, the step ε of the
            second difference (default 0.1). Refused where no estimate takes a step.
        count: the number of random directions, ``None`` for its default:
            ``projection="orthonormal"``, the orthonormal projections (default 1);
            ``method="perturbation"``, the probes per sample, averaged (default 1);
            ``kind="hessian"``, the Rademacher directions per sample (>= 2, default 2).
            Refused where nothing is drawn.
        central: ``method="perturbation"``
            (:func:`~gradreg.penalties.methods.perturbation.perturbation_sq_norms`): the squared
            norm from ‖f(x + σε) − f(x)‖²/σ², ε ~ N(0, I), no double backward, or with ``central``
            the central difference. Only for squared norms with target 0 (R1, R2, double
            backprop, the Jacobian).
        kind: what is penalized, one of :data:`KINDS`: ``"gradient_norm"`` (the module
            docstring of :mod:`~gradreg.penalties.mechanism`), ``"spectral"`` (per-sample
            :math:`\sigma_{\max}` of the input Jacobian by ``iterations`` power-iteration
            steps, in place of the gradient norm) or ``"hessian"`` (the Hessian penalty with
            ``count`` directions, ``step`` and ``reduction`` ``"max"`` or ``"mean"``;
            ``method`` ``"finite_difference"`` or ``"double_backward"``, the exact form). Both
            need ``outputs`` as a callable (:mod:`gradreg.penalties.kinds`).
        iterations: power-iteration steps of ``kind="spectral"``, >= 1.
        shift: for ``points="parameters"`` by ``method="finite_difference"``, how far the
            parameters are shifted along :math:`v = \partial P/\partial g` (the penalty's
            derivative in the loss gradient :math:`g`, its ``gain`` included): ``"normalized"``
            by the length ``step`` (:math:`\theta + r\hat v`: GNP, SAM) or ``"gradient"`` by
            ``step`` times :math:`v` (:math:`\theta + \epsilon v`; for GR's
            :math:`\tfrac12\lVert g\rVert^2`, :math:`\theta + \epsilon g`; ASAM). One of
            :data:`SHIFTS`; see :mod:`~gradreg.penalties.methods.param_gradient`.
        adaptive: for ``points="parameters"`` by ``method="finite_difference"``, the norm of
            :math:`\lvert\theta\rvert \odot g` (elementwise, :math:`\lvert\theta\rvert`
            held constant) in place of that of :math:`g`: ASAM's adaptive sharpness (Kwon et
            al. 2021).

    Examples:
        >>> import dataclasses
        >>> from gradreg.penalties import GradientPenalty, PenaltyConfig
        >>> config = PenaltyConfig(target=1.0, points="interpolates")
        >>> config.squared, config.needs_callable
        (False, False)
        >>> GradientPenalty(dataclasses.replace(config, one_sided=True), weight=10.0)
        GradientPenalty(weight=10.0, target=1.0, points='interpolates', every=1)
        >>> PenaltyConfig(method="finite_difference", step=0.01).uses_count
        False
    """

    target: float | str = 0.0
    one_sided: bool = False
    power: float = 2.0
    p: float = 2.0
    reduction: str = "mean"
    every: int = 1
    points: str = "inputs"
    of: str = "outputs"
    layers: Sequence[str] = ()
    gain: float = 1.0
    order: int = 1
    projection: str = "sum"
    ema_decay: float = 0.01
    check_finite: bool = True
    method: str = "double_backward"
    subsample: float = 1.0
    chunks: int = 1
    step: float | None = None
    count: int | None = None
    central: bool = False
    kind: str = "gradient_norm"
    iterations: int = 10
    shift: str = "normalized"
    adaptive: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))  # a list from a config, frozen
        self._check_types()
        target, method = self.target, self.method
        require(target == "ema" or (isinstance(target, (int, float)) and target >= 0),
                 f"target must be a number >= 0 or 'ema', got {target!r}")
        require(self.power > 0, f"power must be > 0, got {self.power!r}")
        require(self.p > 0, f"p (the norm's order) must be > 0, got {self.p!r}")
        require(self.reduction in REDUCTIONS,
                 f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        require(isinstance(self.every, int) and self.every >= 1,
                 f"every must be an int >= 1 (1 = every step), got {self.every!r}")
        require(self.points in POINTS, f"points must be one of {POINTS}, got {self.points!r}")
        require(self.of in ("outputs", "loss"), f"of must be 'outputs' or 'loss', got {self.of!r}")
        require(self.points != "activations" or len(self.layers) > 0,
                 "points='activations' needs layers=[...] naming the submodules to penalize")
        require(self.projection in PROJECTION_NAMES,
                 f"projection must be one of {PROJECTION_NAMES}, got {self.projection!r}")
        require(isinstance(self.order, int) and self.order >= 1,
                 f"order must be an int >= 1, got {self.order!r}")
        require(self.order == 1 or self.projection == "sum", "order > 1 needs projection='sum'")
        require(0 < self.ema_decay <= 1, f"ema_decay must be in (0, 1], got {self.ema_decay!r}")
        require(self.gain > 0, f"gain must be > 0, got {self.gain!r}")
        check_method_name(method)
        require(method in ("double_backward", "perturbation") or (
            self.projection == "sum" and self.order == 1 and target != "ema"
            and self.points != "activations"
            and (self.points != "parameters" or method == "finite_difference")),
            f"method={method!r} supports projection='sum', order=1, a numeric target and "
            "per-sample points other than 'activations' (and points='parameters' with "
            "method='finite_difference'); use method='double_backward'")
        self._check_kind()
        self._check_perturbation()
        self._check_parameter_shift()
        self._check_step_and_count()
        require(self.reduction != "max" or (self.subsample == 1 and self.chunks == 1),
                f"reduction='max' takes the largest value over the whole batch; subsample="
                f"{self.subsample} and chunks={self.chunks} would take it over part of the batch "
                "(or of one chunk): use subsample=1 and chunks=1")
        require(0 < self.subsample <= 1, f"subsample must be in (0, 1], got {self.subsample!r}")
        chunks = self.chunks
        require(isinstance(chunks, int) and chunks >= 1,
                 f"chunks must be an int >= 1 (1 = the whole batch at once), got {chunks!r}")
        require(chunks == 1 or (method == "double_backward" and target != "ema"
                                 and self.points != "parameters"),
                 f"chunks={chunks} needs method='double_backward', a numeric target (an 'ema' "
                 "target couples the samples) and per-sample points; use chunks=1")

    def _check_types(self) -> None:
        """Numbers (numpy scalars and 0-d tensors converted to float), flags as bools: anything
        else (a string, a bool for a number, an int too large for a float) is refused here."""
        for name in NUMBERS:
            value = getattr(self, name)
            if (name == "target" and value == "ema") or (name == "step" and value is None):
                continue
            number = finite_number(name, value, infinite=name == "p")
            if type(value) not in (int, float):
                object.__setattr__(self, name, number)
        for name in FLAGS:
            require(isinstance(getattr(self, name), bool),
                    f"{name} is a flag: pass True or False, got {getattr(self, name)!r}")

    def _check_perturbation(self) -> None:
        if self.method != "perturbation":
            require(self._at_defaults("central"),
                    f"central sets the perturbation estimate; it does nothing with "
                    f"method={self.method!r}: pass method='perturbation'")
            return
        require(self.kind == "gradient_norm" and self.squared and self.order == 1
                and self.projection in ("sum", "orthonormal")
                and self.points not in ("parameters", "activations"),
                "method='perturbation' estimates squared per-sample norms with target 0 (R1, "
                "R2, double backprop, the Jacobian: target=0, power=2, p=2, order=1, per-sample "
                "points other than 'activations'); for other penalties use "
                "method='double_backward' or 'finite_difference'")
        require(self.chunks == 1, "method='perturbation' keeps no double-backward graph to "
                                  "split: use chunks=1")

    def _check_parameter_shift(self) -> None:
        require(self.shift in SHIFTS, f"shift must be one of {SHIFTS}, got {self.shift!r}")
        shifts = self.points == "parameters" and self.method == "finite_difference"
        require(shifts or self._at_defaults("shift", "adaptive"),
                f"shift and adaptive set how param_grad_norm by method='finite_difference' "
                f"shifts the parameters; they do nothing with points={self.points!r}, "
                f"method={self.method!r}: pass points='parameters', method='finite_difference'")

    def _check_kind(self) -> None:
        require(self.kind in KINDS, f"kind must be one of {KINDS}, got {self.kind!r}")
        check_iterations(self.iterations)
        require(self.kind == "spectral" or self._at_defaults("iterations"),
                "iterations sets the power iteration of kind='spectral'; pass kind='spectral'")
        if self.kind == "gradient_norm":
            return
        if self.kind == "hessian":
            check_hessian_options(count=self.count, step=self.step, reduction=self.reduction,
                                  method=self.method)
        else:
            check_kind_method(self.kind, self.method)
        require(self.chunks == 1 and self.projection == "sum" and self.order == 1
                and self.target != "ema" and self.points not in ("parameters", "activations"),
                f"kind={self.kind!r} takes per-sample points other than 'activations', a "
                "numeric target, projection='sum', order=1 and chunks=1")
        if self.kind == "spectral":
            require(self.p == 2, f"kind='spectral' is the operator 2-norm; got p={self.p!r}")
        else:
            require(self._at_defaults("target", "one_sided", "power", "p"),
                    "kind='hessian' penalizes a variance, not a norm: target, one_sided, power "
                    "and p do not apply; leave them at their defaults")

    def _check_step_and_count(self) -> None:
        """``step`` and ``count`` where an estimate takes them (:attr:`uses_step`,
        :attr:`uses_count`), of the right type and range (those of ``kind="hessian"`` by
        :func:`check_hessian_options`); refused elsewhere."""
        if self.kind != "hessian":
            check_step(self.step)
            check_count(self.count)
        require(self.step is None or self.uses_step,
                f"step sets the step size of method='finite_difference', method='perturbation' "
                f"and kind='hessian' by finite difference; it does nothing with "
                f"method={self.method!r}, kind={self.kind!r}: leave it out")
        require(self.count is None or self.uses_count,
                f"count sets the random directions of projection='orthonormal', "
                f"method='perturbation' (probes) and kind='hessian'; it does nothing with "
                f"projection={self.projection!r}, method={self.method!r}, kind={self.kind!r}: "
                "leave it out")

    def _at_defaults(self, *names: str) -> bool:
        """Whether the options ``names`` are left at their defaults (the fields' own)."""
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        return all(getattr(self, name) == defaults[name] for name in names)

    @property
    def uses_step(self) -> bool:
        """Whether an estimate of this configuration takes ``step``."""
        if self.kind == "hessian":
            return self.method == "finite_difference"
        return self.kind == "gradient_norm" and self.method in ("finite_difference",
                                                                 "perturbation")

    @property
    def uses_count(self) -> bool:
        """Whether this configuration draws random directions, whose number is ``count``."""
        return (self.kind == "hessian" or self.method == "perturbation"
                or self.projection == "orthonormal")

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The names of the options, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, config: PenaltyConfig | None, options: dict[str, Any]) -> PenaltyConfig:
        """``config``, or the configuration of the keyword ``options`` (its fields), for
        ``GradientPenalty(config)`` and ``GradientPenalty(**options)``."""
        if config is not None:
            if options:
                raise TypeError(
                    f"GradientPenalty got a config and options {sorted(options)}: pass one or "
                    "the other (dataclasses.replace(config, ...) to change one).")
            if not isinstance(config, cls):
                raise TypeError(
                    f"GradientPenalty takes a PenaltyConfig or keyword options, got a "
                    f"{type(config).__name__}: GradientPenalty(**options).")
            return config
        check_renamed(options)
        unknown = sorted(set(options) - set(cls.options()))
        if unknown:
            raise TypeError(f"GradientPenalty got unknown option(s) {unknown}; valid: weight, "
                            f"{', '.join(cls.options())}.")
        return cls(**options)

    @property
    def needs_callable(self) -> bool:
        """Whether the penalty runs its own forward: the methods other than double backward,
        ``subsample``, ``chunks`` and the kinds other than ``"gradient_norm"`` do, so
        ``outputs`` must be a callable ``fn(*points)``."""
        return (self.method != "double_backward" or self.subsample < 1 or self.chunks > 1
                or self.kind != "gradient_norm")

    @property
    def per_sample(self) -> bool:
        """Whether the norm is taken per sample (every ``points`` but ``"parameters"``)."""
        return self.points != "parameters"

    @property
    def squared(self) -> bool:
        """Target 0, power 2, norm order 2: the penalty is the squared norm, taken without a
        root (whose derivative is infinite at a zero norm)."""
        return squared_norm_penalty(self.target, self.power, self.p)


def check_method_name(method: object) -> None:
    """Refuse a ``method`` that is not one of :data:`METHODS`; ``"compiled"`` (compiled
    ``torch.func``, removed: slower than the eager double backward in every case measured) with
    a :class:`~gradreg.GradientError` naming the method to pass."""
    if method == "compiled":
        raise GradientError("method='compiled' was removed (it was slower than the eager double "
                            "backward in every case measured): use method='double_backward', "
                            "which is exact.")
    require(method in METHODS, f"method must be one of {METHODS}, got {method!r}")


def check_renamed(options: Any) -> None:
    """Refuse the options of earlier releases (:data:`RENAMED`), naming the option to pass."""
    for old in sorted(set(options) & set(RENAMED)):
        new = RENAMED[old]
        raise TypeError(f"option {old!r} was renamed {new!r}: pass {new}={options[old]!r} (one "
                        "name per concept: step for a step size, count for a number of "
                        "directions).")


def squared_norm_penalty(target: float | str, power: float, p: float) -> bool:
    """Whether a penalty of these options is the squared 2-norm itself (target 0, power 2)."""
    return isinstance(target, (int, float)) and target == 0 and power == 2 and p == 2
