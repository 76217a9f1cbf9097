"""The configuration of a :class:`~gradreg.penalties.GradientPenalty`: one validated value.

A configuration is the composition of the objects it configures, each a frozen dataclass that
checks its own fields: the :class:`~gradreg.penalties.formulas.options.Norm` (target, p, power,
sidedness, reduction, projection), the ``method`` (:data:`~gradreg.penalties.methods
.METHOD_TYPES`: ``DoubleBackward(chunks)``, ``FiniteDifference(step)``, ``ParameterShift(shift,
radius | scale, adaptive)``, ``Perturbation(sigma, count, central)``) and the ``kind``
(:data:`~gradreg.penalties.kinds.KIND_TYPES`: ``GradientNorm()``, ``Spectral(iterations)``,
``Hessian(count, epsilon, reduction)``), with the options of the penalty as a whole (the points,
what is differentiated, laziness, gain, subsample, the finite check). What one object does not
support of the others (a method of another kind, a projection a method does not compute) is
refused when the configuration is built, by that object's ``check``.

Presets and Hydra configs give flat options (``target=1.0, method="finite_difference",
step=1e-3``). The flat options are the fields of the classes (:data:`FLAT`, with their defaults)
and ``step``, an alias for the step size of the chosen method or kind by its role
(``FiniteDifference.step``, ``ParameterShift.radius`` or ``.scale``, ``Perturbation.sigma``,
``Hessian.epsilon``). :meth:`PenaltyConfig.from_flat` is the one adapter: each chosen class takes
its fields, and an option none of them takes, set to other than its default, is refused in one
line naming it, the choice and the options the choice takes. The weight is not part of a
configuration: it may change between steps (schedules) and is checkpointed with the penalty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from gradreg.autograd import GradientError
from gradreg.penalties import kinds, methods
from gradreg.penalties.formulas.options import PROJECTION_NAMES, REDUCTIONS, Norm
from gradreg.penalties.guards.options import Option, check_flag, finite_number, require
from gradreg.penalties.kinds import KINDS, GradientNorm
from gradreg.penalties.methods import METHODS, DoubleBackward, ParameterShift
from gradreg.penalties.methods.finite_difference import SHIFTS

__all__ = ["FLAT", "KINDS", "METHODS", "POINTS", "PROJECTION_NAMES", "REDUCTIONS", "RENAMED",
           "SHIFTS", "PenaltyConfig", "check_method_name", "check_renamed"]

POINTS = ("inputs", "real", "fake", "interpolates", "perturbed", "activations", "latents",
          "parameters")
#: Options of earlier releases and the one that replaced each (checked only when an option is
#: unknown): a step size is ``step`` (or its name by role), a number of directions (projections,
#: probes, Rademacher directions) is ``count``.
RENAMED = {"fd_eps": "step", "num_projections": "count", "probes": "count", "k": "count"}


@dataclass(frozen=True)
class PenaltyConfig:
    r"""What a penalty computes and how (the formula is in :mod:`gradreg.penalties.mechanism`).

    Attributes:
        norm: the norm and its penalty (:class:`~gradreg.penalties.formulas.options.Norm`).
        method: how the parameter gradient is computed (one of :data:`~gradreg.penalties
            .methods.METHOD_TYPES`, or :class:`~gradreg.penalties.methods.ParameterShift` for
            ``points="parameters"``); its name is ``config.method.name``.
        kind: what is penalized (one of :data:`~gradreg.penalties.kinds.KIND_TYPES`), named
            ``config.kind.name``.
        points, of, layers, every, gain, subsample, check_finite: as in :meth:`from_flat`.

    The flat options are read as attributes too (``config.target``, ``config.step``: the value
    of the object that takes it, ``step`` that of the chosen step size, else the option's
    default). Build one from flat options with
    :meth:`from_flat`, change some with :meth:`replace`.

    Examples:
        >>> from gradreg.penalties import FiniteDifference, GradientPenalty, Norm, PenaltyConfig
        >>> config = PenaltyConfig(Norm(target=1.0), FiniteDifference(step=1e-3),
        ...                        points="interpolates")
        >>> config == PenaltyConfig.from_flat(target=1.0, method="finite_difference", step=1e-3,
        ...                            points="interpolates")
        True
        >>> config.method.name, config.step, config.squared
        ('finite_difference', 0.001, False)
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

    #: The parts that take flat options, in the order a shared option (``reduction``) is read
    #: from and the alias ``step`` is routed (the kind's step before the method's).
    PARTS: ClassVar[tuple[str, ...]] = ("kind", "method", "norm")

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))  # a list from a config, frozen
        for name, types in (("norm", (Norm,)), ("method", (*methods.METHOD_TYPES, ParameterShift)),
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
        """A flat option: the value of the part that takes it (``step``: the chosen step size
        by its role), else its default."""
        if name not in FLAT:
            raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")
        for part in self.PARTS:
            value = self.__dict__.get(part)
            if value is None:
                continue
            key = type(value).step_field(value.flat()) if name == "step" else name
            if key is not None and key in value.__dataclass_fields__:
                return getattr(value, key)
        return FLAT[name]

    @classmethod
    def from_flat(cls, **options: Any) -> PenaltyConfig:
        r"""The configuration of flat ``options`` (:data:`FLAT`; those left out at their
        defaults): the one adapter from the presets' and the Hydra configs' keywords. Each
        chosen class (the norm, the ``method``'s, the ``kind``'s) takes its fields; an option
        none of them takes is refused unless it is at its default.

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
            step: an alias for the step size of the estimate that takes one, by its role
                (``None`` for its default): ``method="finite_difference"``, ``step``, the
                input-space length of each sample's shift (for ``points="parameters"``, the
                parameter-space ``radius`` :math:`r` of the shift or the ``scale`` of
                ``shift="gradient"``, :mod:`~gradreg.penalties.methods.param_gradient`), by default
                :func:`~gradreg.penalties.guards.precision.default_step` for the precision the
                model's arithmetic ran in
                (:func:`~gradreg.penalties.guards.precision.unit_roundoff`: float64, float32, or
                TF32 on GPUs); ``method="perturbation"``, ``sigma``, the probe's scale σ per
                element (default 0.01); ``kind="hessian"`` by finite difference, ``epsilon``, the
                step ε of the second difference (default 0.1). Refused where no estimate takes a
                step, and with the name it stands for.
            sigma, epsilon, radius, scale: the step sizes by their role (above).
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
                by the length ``radius`` (:math:`\theta + r\hat v`: GNP, SAM) or ``"gradient"`` by
                ``scale`` times :math:`v` (:math:`\theta + \epsilon v`; for GR's
                :math:`\tfrac12\lVert g\rVert^2`, :math:`\theta + \epsilon g`; ASAM). One of
                :data:`SHIFTS`; see :mod:`~gradreg.penalties.methods.param_gradient`.
            adaptive: for ``points="parameters"`` by ``method="finite_difference"``, the norm of
                :math:`\lvert\theta\rvert \odot g` (elementwise, :math:`\lvert\theta\rvert`
                held constant) in place of that of :math:`g`: ASAM's adaptive sharpness (Kwon et
                al. 2021).

        Examples:
            >>> from gradreg.penalties import PenaltyConfig
            >>> PenaltyConfig.from_flat(method="perturbation", step=0.01, count=4).method
            Perturbation(sigma=0.01, count=4, central=False)
            >>> PenaltyConfig.from_flat(kind="spectral", iterations=5).kind
            Spectral(iterations=5)
            >>> PenaltyConfig.from_flat(central=True)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: central=True is not an option of method='double_backward', ...
        """
        unknown = sorted(set(options) - set(FLAT))
        if unknown:
            check_renamed(options)
            raise TypeError(f"GradientPenalty got unknown option(s) {unknown}; valid: weight, "
                            f"{', '.join(FLAT)}.")
        flat = {**FLAT, **options}
        _convert_numbers(flat)
        check_method_name(flat["method"])
        kind_type = _chosen(kinds.KIND_TYPES, "kind", flat["kind"])
        method_type = _named(methods.METHOD_TYPES)[flat["method"]].form(flat)
        parts = {"kind": kind_type, "method": method_type, "norm": Norm}
        _route_step(flat, options, parts)
        taken = {*_CONFIG_KEYS, *parts}.union(*(part.flat_keys(flat) for part in parts.values()))
        for key in options:
            if key not in taken and flat[key] != FLAT[key]:
                _refuse(key, flat, parts)
        return cls(Norm.from_flat(flat), method_type.from_flat(flat), kind_type.from_flat(flat),
                   **{key: flat[key] for key in _CONFIG_KEYS})

    def flat(self) -> dict[str, Any]:
        """The flat options of this configuration (:meth:`from_flat` of them gives it back)."""
        parts = [self.norm, self.method, self.kind]
        return ({name: getattr(self, name) for name in _CONFIG_KEYS}
                | {key: value for part in parts for key, value in part.flat().items()}
                | {"method": self.method.name, "kind": self.kind.name})

    def replace(self, **options: Any) -> PenaltyConfig:
        """This configuration with the flat ``options`` changed (:meth:`from_flat`); the alias
        ``step`` replaces the step size by its role."""
        flat = self.flat()
        if "step" in options:
            flat = {key: value for key, value in flat.items() if key not in _STEP_FIELDS}
        return PenaltyConfig.from_flat(**{**flat, **options})

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
        return (self.method.name != "double_backward" or self.subsample < 1
                or self.method.chunks > 1 or self.kind.name != "gradient_norm")

    @property
    def per_sample(self) -> bool:
        """Whether the norm is taken per sample (every ``points`` but ``"parameters"``)."""
        return self.points != "parameters"

    @property
    def squared(self) -> bool:
        """Target 0, power 2, norm order 2: the penalty is the squared norm, taken without a
        root (whose derivative is infinite at a zero norm)."""
        return self.norm.squared


#: The options of the penalty as a whole, with their defaults (the configuration's own fields).
_CONFIG_KEYS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(PenaltyConfig)
    if f.name not in PenaltyConfig.PARTS}


def _defaults(*types: type[Option]) -> dict[str, Any]:
    """The fields of ``types`` and their defaults, the first class's where two share a name."""
    found: dict[str, Any] = {}
    for option in types:
        for f in dataclasses.fields(option):
            found.setdefault(f.name, f.default)
    return found


_OPTION_TYPES: tuple[type[Option], ...] = (Norm, *methods.METHOD_TYPES, ParameterShift,
                                           *kinds.KIND_TYPES)
#: The flat options and their defaults (those of :meth:`PenaltyConfig.from_flat`, the presets'
#: and the Hydra configs' keywords): the configuration's own, ``method`` and ``kind``, the fields
#: of the option classes, and the alias ``step``.
FLAT: dict[str, Any] = {**_defaults(Norm), **_CONFIG_KEYS, "method": DoubleBackward.name,
                        "kind": GradientNorm.name, **_defaults(*_OPTION_TYPES), "step": None}


#: The fields the alias ``step`` may set.
_STEP_FIELDS = {option.step_field({**FLAT, "shift": shift}) for option in _OPTION_TYPES
                for shift in SHIFTS} - {None}


def _typed(word: str) -> tuple[str, ...]:
    """The flat options whose fields are annotated with ``word`` (``"float"``, ``"bool"``)."""
    fields = [f for option in (PenaltyConfig, *_OPTION_TYPES)
              for f in dataclasses.fields(option)]
    return tuple(dict.fromkeys(f.name for f in fields if word in str(f.type).split(" | ")))


#: The flat options that are real numbers (``p`` may also be ``inf``: the max-norm), a numpy
#: scalar or a 0-d tensor converted to ``float``; the step sizes among them also take ``None``.
NUMBERS = _typed("float")
#: The flat options that are flags.
FLAGS = _typed("bool")


def _named(types: tuple[type[Option], ...]) -> dict[str, type[Option]]:
    """The option classes by name: the registry of a flat option's values, read when used (a
    class added to the tuple is a valid value)."""
    return {option.name: option for option in types}


def _chosen(types: tuple[type[Option], ...], option: str, name: object) -> type[Option]:
    """The class of ``types`` named ``name``, the value of the flat ``option``."""
    named = _named(types)
    require(name in named, f"{option} must be one of {tuple(named)}, got {name!r}")
    return named[name]


def _convert_numbers(flat: dict[str, Any]) -> None:
    """A numpy scalar or a 0-d tensor given for a number is converted to ``float`` in ``flat``;
    flags must be bools. The classes check their fields' values themselves."""
    for name in NUMBERS:
        value = flat[name]
        if isinstance(value, Tensor) or type(value).__module__ == "numpy":
            flat[name] = finite_number(name, value, infinite=name == "p")
    for name in FLAGS:
        check_flag(name, flat[name])


def _route_step(flat: dict[str, Any], options: dict[str, Any],
                parts: dict[str, type[Option]]) -> None:
    """The alias ``step`` set on the field of the first part (the kind's before the method's)
    that takes a step size; left out where none does (and then refused)."""
    step = flat["step"]
    if step is None:
        return
    for part in parts.values():
        field_name = part.step_field(flat)
        if field_name is None:
            continue
        if field_name != "step":
            if options.get(field_name) is not None:
                raise ValueError(f"step is the alias of {field_name}: pass one of step={step!r} "
                                 f"and {field_name}={options[field_name]!r}.")
            flat[field_name], flat["step"] = step, None
        return


def _refuse(key: str, flat: dict[str, Any], parts: dict[str, type[Option]]) -> None:
    """Refuse ``key``, which the chosen classes ``parts`` do not take, in one line naming the
    choice, the options it takes and the choices that take ``key``."""
    choice = f"method={flat['method']!r}, kind={flat['kind']!r}"
    if parts["method"] is ParameterShift:
        choice += ", points='parameters'"
    own = sorted({k for name in ("method", "kind") for k in parts[name].flat_keys(flat)}
                 | ({"step"} if any(p.step_field(flat) for p in parts.values()) else set()))
    takers = [f"{category}={option.name!r}" + (", points='parameters'"
                                               if option is ParameterShift else "")
              for category, types in (("method", (*methods.METHOD_TYPES, ParameterShift)),
                                      ("kind", kinds.KIND_TYPES))
              for option in types
              if key in _defaults(option) or (key == "step" and option.step_field(flat))]
    if key in _defaults(Norm):  # the norm's count, taken with projection="orthonormal" only
        takers.append("projection='orthonormal'")
    require(False, f"{key}={flat[key]!r} is not an option of {choice}, which take"
                   f" {', '.join(own) or 'none of their own'} besides the norm's and the "
                   f"penalty's: leave it out, or choose {' or '.join(takers)}")


def check_method_name(method: object) -> None:
    """Refuse a ``method`` that is not one of :data:`METHODS`; ``"compiled"`` (compiled
    ``torch.func``, removed: slower than the eager double backward in every case measured) with
    a :class:`~gradreg.GradientError` naming the method to pass."""
    names = _named(methods.METHOD_TYPES)
    if method in names:
        return
    if method == "compiled":
        raise GradientError("method='compiled' was removed (it was slower than the eager double "
                            "backward in every case measured): use method='double_backward', "
                            "which is exact.")
    require(False, f"method must be one of {tuple(names)}, got {method!r}")


def check_renamed(options: Any) -> None:
    """Refuse the options of earlier releases (:data:`RENAMED`), naming the option to pass;
    called where an option is unknown, not on every configuration."""
    for old in sorted(set(options) & set(RENAMED)):
        new = RENAMED[old]
        raise TypeError(f"option {old!r} was renamed {new!r}: pass {new}={options[old]!r} (one "
                        "name per concept: step for a step size, count for a number of "
                        "directions).")
