"""The configuration of a :class:`~gradreg.penalties.GradientPenalty`: one validated value.

A configuration is the composition of the objects it configures, each a frozen dataclass that
checks its own fields: the :class:`~gradreg.penalties.formulas.options.Norm` (target, p, power,
sidedness, reduction, projection), the ``method`` (:data:`~gradreg.penalties.methods
.METHOD_TYPES`: ``DoubleBackward(chunks)``, ``FiniteDifference(step)``, ``ParameterShift(step,
shift, adaptive)``, ``Perturbation(step, count, central)``) and the ``kind``
(:data:`~gradreg.penalties.kinds.KIND_TYPES`: ``GradientNorm()``, ``Spectral(iterations)``,
``Hessian(count, step, reduction)``), with the options of the penalty as a whole (the points,
what is differentiated, laziness, gain, subsample, the finite check). What one object does not
support of the others (a method of another kind, a projection a method does not compute) is
refused when the configuration is built, by that object's ``check``.

Presets and Hydra configs give flat options (``target=1.0, method="finite_difference",
step=1e-3``); :meth:`PenaltyConfig.from_flat` is the one adapter from them, routing each option to
the object that takes it and refusing, with the fix, an option no chosen object takes. The weight
is not part of a configuration: it may change between steps (schedules) and is checkpointed with
the penalty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gradreg.autograd import GradientError
from gradreg.penalties import kinds, methods
from gradreg.penalties.formulas.options import PROJECTION_NAMES, REDUCTIONS, Norm
from gradreg.penalties.guards.options import (
    Option,
    check_count,
    check_flag,
    check_iterations,
    check_step,
    finite_number,
    require,
)
from gradreg.penalties.kinds import KINDS, GradientNorm
from gradreg.penalties.methods import METHODS, DoubleBackward
from gradreg.penalties.methods.finite_difference import SHIFTS

__all__ = ["FLAT", "KINDS", "METHODS", "POINTS", "PROJECTION_NAMES", "REDUCTIONS", "RENAMED",
           "SHIFTS", "PenaltyConfig", "check_method_name", "check_renamed"]

POINTS = ("inputs", "real", "fake", "interpolates", "perturbed", "activations", "latents",
          "parameters")
#: Options of earlier releases and the one that replaced each: a step size is ``step``, a
#: number of directions (projections, probes, Rademacher directions) is ``count``.
RENAMED = {"fd_eps": "step", "sigma": "step", "epsilon": "step", "num_projections": "count",
           "probes": "count", "k": "count"}
#: The flat options and their defaults (those of :meth:`PenaltyConfig.from_flat`, the presets' and
#: the Hydra configs' keywords).
FLAT: dict[str, Any] = {
    "target": 0.0, "one_sided": False, "power": 2.0, "p": 2.0, "reduction": "mean", "every": 1,
    "points": "inputs", "of": "outputs", "layers": (), "gain": 1.0, "order": 1,
    "projection": "sum", "ema_decay": 0.01, "check_finite": True, "method": "double_backward",
    "subsample": 1.0, "chunks": 1, "step": None, "count": None, "central": False,
    "kind": "gradient_norm", "iterations": 10, "shift": "normalized", "adaptive": False}
#: The flat options that are real numbers (``p`` may also be ``inf``: the max-norm), converted to
#: ``float``; ``target`` also takes ``"ema"``, ``step`` also ``None``.
NUMBERS = ("target", "power", "p", "gain", "ema_decay", "subsample", "step")
#: The flat options that are flags.
FLAGS = ("one_sided", "check_finite", "central", "adaptive")
#: The flat options of the norm (:class:`~gradreg.penalties.formulas.options.Norm`).
NORM_OPTIONS = ("target", "one_sided", "power", "p", "reduction", "projection", "order",
                "ema_decay")


@dataclass(frozen=True)
class PenaltyConfig:
    r"""What a penalty computes and how (the formula is in :mod:`gradreg.penalties.mechanism`).

    Attributes:
        norm: the norm and its penalty (:class:`~gradreg.penalties.formulas.options.Norm`).
        method: how the parameter gradient is computed (one of :data:`~gradreg.penalties
            .methods.METHOD_TYPES`, or :class:`~gradreg.penalties.methods.ParameterShift` for
            ``points="parameters"``); it compares equal to its name
            (``config.method == "finite_difference"``).
        kind: what is penalized (one of :data:`~gradreg.penalties.kinds.KIND_TYPES`), equal to
            its name.
        points, of, layers, every, gain, subsample, check_finite: as in :meth:`from_flat`.

    The flat options are read as attributes too (``config.target``, ``config.step``: the value
    of the object that takes it, else the option's default). Build one from flat options with
    :meth:`from_flat`, change some with :meth:`replace`.

    Examples:
        >>> from gradreg.penalties import FiniteDifference, GradientPenalty, Norm, PenaltyConfig
        >>> config = PenaltyConfig(Norm(target=1.0), FiniteDifference(step=1e-3),
        ...                        points="interpolates")
        >>> config == PenaltyConfig.from_flat(target=1.0, method="finite_difference", step=1e-3,
        ...                            points="interpolates")
        True
        >>> config.method == "finite_difference", config.step, config.squared
        (True, 0.001, False)
        >>> GradientPenalty(config.replace(one_sided=True), weight=10.0)
        GradientPenalty(weight=10.0, target=1.0, points='interpolates', every=1)
    """

    norm: Norm = field(default_factory=Norm)
    method: Option = field(default_factory=DoubleBackward)
    kind: Option = field(default_factory=GradientNorm)
    points: str = "inputs"
    of: str = "outputs"
    layers: Sequence[str] = ()
    every: int = 1
    gain: float = 1.0
    subsample: float = 1.0
    check_finite: bool = True

    #: The parts that take flat options, in the order a shared option (``step``, ``count``) is
    #: read from.
    PARTS: ClassVar[tuple[str, ...]] = ("kind", "method", "norm")

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))  # a list from a config, frozen
        for name, types in (("norm", (Norm,)), ("method", methods.METHOD_TYPES),
                            ("kind", kinds.KIND_TYPES)):
            require(isinstance(getattr(self, name), types),
                    f"{name} must be one of {[t.__name__ for t in types]}, got "
                    f"{getattr(self, name)!r}")
        for name in ("gain", "subsample"):
            value = getattr(self, name)
            number = finite_number(name, value)
            if type(value) not in (int, float):
                object.__setattr__(self, name, number)
        check_flag("check_finite", self.check_finite)
        require(isinstance(self.every, int) and self.every >= 1,
                f"every must be an int >= 1 (1 = every step), got {self.every!r}")
        require(self.points in POINTS, f"points must be one of {POINTS}, got {self.points!r}")
        require(self.of in ("outputs", "loss"), f"of must be 'outputs' or 'loss', got {self.of!r}")
        require(self.points != "activations" or len(self.layers) > 0,
                "points='activations' needs layers=[...] naming the submodules to penalize")
        require(self.gain > 0, f"gain must be > 0, got {self.gain!r}")
        self.kind.check(self)
        self.method.check(self)
        chunks = getattr(self.method, "chunks", 1)
        require(self.norm.reduction != "max" or (self.subsample == 1 and chunks == 1),
                f"reduction='max' takes the largest value over the whole batch; subsample="
                f"{self.subsample} and chunks={chunks} would take it over part of the batch "
                "(or of one chunk): use subsample=1 and chunks=1")
        require(0 < self.subsample <= 1, f"subsample must be in (0, 1], got {self.subsample!r}")

    def __getattr__(self, name: str) -> Any:
        """A flat option: the value of the part that takes it, else its default."""
        if name not in FLAT:
            raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")
        for part in self.PARTS:
            value = self.__dict__.get(part)
            if name in getattr(value, "__dataclass_fields__", ()):
                return getattr(value, name)
        return FLAT[name]

    @classmethod
    def from_flat(cls, **options: Any) -> PenaltyConfig:
        r"""The configuration of flat ``options`` (:data:`FLAT`; those left out at their
        defaults): the one adapter from the presets' and the Hydra configs' keywords.

            Args:
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
                passed as a tensor), the penalty or the weighted penalty holds NaN or Inf, instead
                of letting it pass silently (:class:`~gradreg.penalties.guards.finite.FiniteCheck`;
                for ``points="parameters"`` the penalty is a function of the loss's gradient there,
                which a non-finite parameter makes non-finite, so the value's check covers them
                without a pass over every parameter): on the CPU at once, before the value is used;
                on CUDA without a host sync, at a later call (normally the next) that names the
                call, after that call's optimizer step; ``finite_check.settle()`` waits for all. Not
                under a ``loss_scale``: there a non-finite value is the GradScaler's overflow
                signal, and the scaler skips the step and lowers its scale.
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
                :func:`~gradreg.penalties.guards.precision.default_step` for the precision the
                model's arithmetic ran in
                (:func:`~gradreg.penalties.guards.precision.unit_roundoff`: float64, float32, or
                TF32 on GPUs); ``method="perturbation"``, the probe's scale σ per element (default
                0.01); ``kind="hessian"`` by finite difference, the step ε of the second difference
                (default 0.1). Refused where no estimate takes a step.
            count: the number of random directions, ``None`` for its default:
                ``projection="orthonormal"``, the orthonormal projections (default 1);
                ``method="perturbation"``, the probes per sample, averaged (default 1);
                ``kind="hessian"``, the Rademacher directions per sample (>= 2, default 2).
                Refused where nothing is drawn.
            central: ``method="perturbation"``
                (:func:`~gradreg.penalties.methods.perturbation.perturbation_sq_norms`): the squared
                norm from ‖f(x + σε) − f(x)‖²/σ², ε ~ N(0, I), no double backward, or with
                ``central`` the central difference. Only for squared norms with target 0 (R1, R2,
                double backprop, the Jacobian).
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
            >>> from gradreg.penalties import PenaltyConfig
            >>> PenaltyConfig.from_flat(method="perturbation", step=0.01, count=4).method
            Perturbation(step=0.01, count=4, central=False)
            >>> PenaltyConfig.from_flat(kind="spectral", iterations=5).kind
            Spectral(iterations=5)
            >>> PenaltyConfig.from_flat(central=True)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: central sets the perturbation estimate; it does nothing with ...
        """
        check_renamed(options)
        unknown = sorted(set(options) - set(FLAT))
        if unknown:
            raise TypeError(f"GradientPenalty got unknown option(s) {unknown}; valid: weight, "
                            f"{', '.join(FLAT)}.")
        flat = {**FLAT, **options}
        _check_flat_types(flat)
        norm = Norm(**{name: flat[name] for name in NORM_OPTIONS},
                    count=flat["count"] if flat["projection"] == "orthonormal" else None)
        method, kind = flat["method"], flat["kind"]
        check_method_name(method)
        require(kind in _named(kinds.KIND_TYPES),
                f"kind must be one of {tuple(_named(kinds.KIND_TYPES))}, got {kind!r}")
        check_iterations(flat["iterations"])
        require(kind == "spectral" or flat["iterations"] == FLAT["iterations"],
                "iterations sets the power iteration of kind='spectral'; pass kind='spectral'")
        require(method == "perturbation" or flat["central"] == FLAT["central"],
                f"central sets the perturbation estimate; it does nothing with "
                f"method={method!r}: pass method='perturbation'")
        require(method != "perturbation" or flat["chunks"] == 1,
                "method='perturbation' keeps no double-backward graph to split: use chunks=1")
        _check_chunks(flat["chunks"], method)
        require(flat["shift"] in SHIFTS, f"shift must be one of {SHIFTS}, got {flat['shift']!r}")
        shifts = flat["points"] == "parameters" and method == "finite_difference"
        require(shifts or (flat["shift"], flat["adaptive"]) == (FLAT["shift"], FLAT["adaptive"]),
                f"shift and adaptive set how param_grad_norm by method='finite_difference' "
                f"shifts the parameters; they do nothing with points={flat['points']!r}, "
                f"method={method!r}: pass points='parameters', method='finite_difference'")
        _check_step_and_count(flat)
        kind_options = _named(kinds.KIND_TYPES)[kind].from_flat(flat)
        if kind == "hessian":  # the step of the Hessian's second difference is the kind's
            flat["step"] = None
        method_options = _named(methods.METHOD_TYPES)[method].from_flat(flat)
        return cls(norm, method_options, kind_options, points=flat["points"], of=flat["of"],
                   layers=flat["layers"], every=flat["every"], gain=flat["gain"],
                   subsample=flat["subsample"], check_finite=flat["check_finite"])

    def flat(self) -> dict[str, Any]:
        """The flat options of this configuration (:meth:`from_flat` of them gives it back)."""
        return {name: getattr(self, name) for name in FLAT} | {
            "method": self.method.name, "kind": self.kind.name}

    def replace(self, **options: Any) -> PenaltyConfig:
        """This configuration with the flat ``options`` changed (:meth:`from_flat`)."""
        return PenaltyConfig.from_flat(**{**self.flat(), **options})

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The names of the flat options, in order."""
        return tuple(FLAT)

    @classmethod
    def from_options(cls, config: PenaltyConfig | None, options: dict[str, Any]) -> PenaltyConfig:
        """``config``, or the configuration of the flat keyword ``options`` (:meth:`from_flat`), for
        ``GradientPenalty(config)`` and ``GradientPenalty(**options)``."""
        if config is not None:
            if options:
                raise TypeError(
                    f"GradientPenalty got a config and options {sorted(options)}: pass one or "
                    "the other (config.replace(...) to change one).")
            if not isinstance(config, cls):
                raise TypeError(
                    f"GradientPenalty takes a PenaltyConfig or keyword options, got a "
                    f"{type(config).__name__}: GradientPenalty(**options).")
            return config
        return cls.from_flat(**options)

    @property
    def needs_callable(self) -> bool:
        """Whether the penalty runs its own forward: the methods other than double backward,
        ``subsample``, ``chunks`` and the kinds other than ``"gradient_norm"`` do, so
        ``outputs`` must be a callable ``fn(*points)``."""
        return (self.method != "double_backward" or self.subsample < 1
                or self.method.chunks > 1 or self.kind != "gradient_norm")

    @property
    def per_sample(self) -> bool:
        """Whether the norm is taken per sample (every ``points`` but ``"parameters"``)."""
        return self.points != "parameters"

    @property
    def squared(self) -> bool:
        """Target 0, power 2, norm order 2: the penalty is the squared norm, taken without a
        root (whose derivative is infinite at a zero norm)."""
        return self.norm.squared


def _named(types: tuple[type[Option], ...]) -> dict[str, type[Option]]:
    """The option classes by name: the registry of a flat option's values, read when used (a
    class added to the tuple is a valid value)."""
    return {option.name: option for option in types}


def _check_flat_types(flat: dict[str, Any]) -> None:
    """Numbers (numpy scalars and 0-d tensors converted to float in ``flat``), flags as bools:
    anything else (a string, a bool for a number, an int too large for a float) is refused."""
    for name in NUMBERS:
        value = flat[name]
        if (name == "target" and value == "ema") or (name == "step" and value is None):
            continue
        number = finite_number(name, value, infinite=name == "p")
        if type(value) not in (int, float):
            flat[name] = number
    for name in FLAGS:
        check_flag(name, flat[name])


def _check_chunks(chunks: object, method: str) -> None:
    require(isinstance(chunks, int) and chunks >= 1,
            f"chunks must be an int >= 1 (1 = the whole batch at once), got {chunks!r}")
    require(chunks == 1 or method == "double_backward",
            f"chunks={chunks} needs method='double_backward', a numeric target (an 'ema' "
            "target couples the samples) and per-sample points; use chunks=1")


def _check_step_and_count(flat: dict[str, Any]) -> None:
    """``step`` and ``count`` where an object takes them, of the right type and range (those of
    ``kind="hessian"`` by :class:`~gradreg.penalties.kinds.Hessian`); refused elsewhere."""
    method, kind = flat["method"], flat["kind"]
    if kind != "hessian":
        check_step(flat["step"])
        check_count(flat["count"])
    uses_step = (method == "finite_difference" if kind == "hessian"
                 else kind == "gradient_norm" and method in ("finite_difference", "perturbation"))
    uses_count = (kind == "hessian" or method == "perturbation"
                  or flat["projection"] == "orthonormal")
    require(flat["step"] is None or uses_step,
            f"step sets the step size of method='finite_difference', method='perturbation' "
            f"and kind='hessian' by finite difference; it does nothing with "
            f"method={method!r}, kind={kind!r}: leave it out")
    require(flat["count"] is None or uses_count,
            f"count sets the random directions of projection='orthonormal', "
            f"method='perturbation' (probes) and kind='hessian'; it does nothing with "
            f"projection={flat['projection']!r}, method={method!r}, kind={kind!r}: "
            "leave it out")


def check_method_name(method: object) -> None:
    """Refuse a ``method`` that is not one of :data:`METHODS`; ``"compiled"`` (compiled
    ``torch.func``, removed: slower than the eager double backward in every case measured) with
    a :class:`~gradreg.GradientError` naming the method to pass."""
    if method == "compiled":
        raise GradientError("method='compiled' was removed (it was slower than the eager double "
                            "backward in every case measured): use method='double_backward', "
                            "which is exact.")
    names = tuple(_named(methods.METHOD_TYPES))
    require(method in names, f"method must be one of {names}, got {method!r}")


def check_renamed(options: Any) -> None:
    """Refuse the options of earlier releases (:data:`RENAMED`), naming the option to pass."""
    for old in sorted(set(options) & set(RENAMED)):
        new = RENAMED[old]
        raise TypeError(f"option {old!r} was renamed {new!r}: pass {new}={options[old]!r} (one "
                        "name per concept: step for a step size, count for a number of "
                        "directions).")
