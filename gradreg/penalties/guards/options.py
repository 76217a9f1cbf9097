"""The checks of single option values, shared by the configuration and the functions that take
the same options directly (:func:`~gradreg.penalties.kinds.hessian.hessian_penalty`,
:func:`~gradreg.penalties.kinds.spectral.spectral_norms`): each refuses a bad value with a
:class:`ValueError` that names the option and what it takes."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = ["Option", "check_count", "check_flag", "check_iterations", "check_kind_method",
           "check_per_sample_kind", "check_step", "finite_number", "require"]


class Option:
    """The base of the option objects (a norm, a method, a kind): frozen dataclasses that check
    their own fields when built, each registered under its :attr:`name`. Their fields are their
    flat options (:meth:`flat_keys`, read by
    :meth:`~gradreg.penalties.config.PenaltyConfig.from_flat`), each named by its role (the
    perturbation's ``sigma``, the Hessian's ``epsilon``); the flat alias ``step`` sets the field
    :meth:`step_field` names. Two option objects are equal where their types and fields are; an
    object is not equal to its name (compare ``config.method.name``)."""

    #: The name the object is chosen by in flat options (``method="finite_difference"``).
    name: ClassVar[str]

    @classmethod
    def flat_keys(cls, flat: dict[str, Any]) -> tuple[str, ...]:
        """The flat options this class takes, given the others (``flat``): its fields."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def form(cls, flat: dict[str, Any]) -> type[Option]:
        """The class that takes ``flat`` (a method may have another form for some points)."""
        return cls

    @classmethod
    def step_field(cls, flat: dict[str, Any]) -> str | None:
        """The field the flat alias ``step`` sets (its step size by its role), or None."""
        return None

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> Option:
        """The object of the flat options ``flat`` (all of them, defaults included)."""
        return cls(**{key: flat[key] for key in cls.flat_keys(flat)})

    def flat(self) -> dict[str, Any]:
        """Its flat options: its fields by name."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.values() == self.values()

    def __hash__(self) -> int:
        return hash((type(self), self.values()))


def check_flag(name: str, value: object) -> None:
    """Refuse a flag that is not a bool (a string ``"false"`` would be true)."""
    require(isinstance(value, bool), f"{name} is a flag: pass True or False, got {value!r}")


def require(condition: bool, message: str) -> None:
    """Raise :class:`ValueError` with ``message`` (and a full stop) unless ``condition``."""
    if not condition:
        raise ValueError(message + ".")


def check_step(step: float | None, name: str = "step") -> None:
    """Refuse a step size ``name`` that is not a number > 0 (``None``: the estimate's
    default)."""
    require(step is None or (isinstance(step, numbers.Real) and not isinstance(step, bool)
                             and step > 0),
            f"{name} (the estimate's step size) must be a number > 0 or None (its default), got "
            f"{step!r}")


def check_count(count: int | None, least: int = 1, why: str = "") -> None:
    """Refuse a number of random directions that is not an int >= ``least`` (``None``: the
    estimate's default); ``why`` says why where ``least`` is more than 1."""
    require(count is None or (isinstance(count, int) and not isinstance(count, bool)
                              and count >= least),
            f"count (random directions per sample) must be an int >= {least} or None (its "
            f"default){why}; got {count!r}")


def check_iterations(iterations: int) -> None:
    """Refuse a number of power-iteration steps that is not an int >= 1."""
    require(isinstance(iterations, int) and not isinstance(iterations, bool) and iterations >= 1,
            f"iterations must be an int >= 1 (power-iteration steps), got {iterations!r}")


def check_kind_method(kind: str, method: str, methods: tuple[str, ...]) -> None:
    """Refuse a ``method`` other than the ``methods`` that compute ``kind`` (the kind's own
    ``methods``)."""
    require(method in methods, f"kind={kind!r} is computed by method "
                               f"{' or '.join(map(repr, methods))}, got method={method!r}")


def check_per_sample_kind(kind: str, config: Any) -> None:
    """Refuse for ``kind`` (``"spectral"``, ``"hessian"``: they run the model on the whole
    batch) coupled or non-per-sample configurations (``config``: a
    :class:`~gradreg.penalties.config.PenaltyConfig`)."""
    norm = config.norm
    require(getattr(config.method, "chunks", 1) == 1 and norm.projection == "sum"
            and norm.order == 1 and norm.target != "ema"
            and config.points not in ("parameters", "activations"),
            f"kind={kind!r} takes per-sample points other than 'activations', a numeric target, "
            "projection='sum', order=1 and chunks=1")


def finite_number(name: str, value: object, *, minimum: float | None = None,
                  infinite: bool = False) -> float:
    """``value`` as a float: a real number (Python's, numpy's) or a 0-d real tensor or numpy
    array, finite (``infinite``: also +-inf, never NaN) and ``>= minimum``; :class:`ValueError`
    naming ``name`` otherwise (a bool, a string, an int too large for a float)."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()  # a numpy scalar or 0-d array: its Python number (bool stays bool)
    if isinstance(value, Tensor):
        require(value.ndim == 0 and not (value.is_complex() or value.dtype == torch.bool),
                f"{name} must be a number, got a tensor of shape {tuple(value.shape)} and dtype "
                f"{value.dtype}: pass a float or a 0-d real tensor")
        value = value.item()
    require(isinstance(value, numbers.Real) and not isinstance(value, bool),
            f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{name} is an integer of {int(value).bit_length()} bits, too large for "
                         "a float (at most about 1.8e308): pass a finite number.") from None
    bound = "" if minimum is None else f" >= {minimum:g}"
    require((math.isfinite(number) or (infinite and not math.isnan(number)))
            and (minimum is None or number >= minimum),
            f"{name} must be a {'' if infinite else 'finite '}number{bound}, got {value!r}")
    return number
