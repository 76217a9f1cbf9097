"""Named configurations of :class:`GradientPenalty`: the published penalties, nothing more.

Each preset is a dict of :class:`GradientPenalty` options (:data:`PRESETS`) and a function of the
same name that builds it, taking the weight as its only positional argument:
``wgan_gp(0.1)`` is ``wgan_gp(weight=0.1)`` is ``make_penalty("wgan_gp", weight=0.1)``; every
other option is a keyword (``r1(1.0, every=16)``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from gradreg.penalties.config import PenaltyConfig, check_renamed
from gradreg.penalties.mechanism import GradientPenalty

__all__ = ["PRESETS", "make_penalty"]

PRESETS: dict[str, dict[str, Any]] = {
    "wgan_gp": {"weight": 10.0, "target": 1.0, "points": "interpolates"},
    "wgan_lp": {"weight": 10.0, "target": 1.0, "one_sided": True, "points": "interpolates"},
    "r1": {"weight": 10.0, "gain": 0.5, "points": "real"},
    "r2": {"weight": 10.0, "gain": 0.5, "points": "fake"},
    "dragan": {"weight": 10.0, "target": 1.0, "points": "perturbed"},
    "double_backprop": {"weight": 0.1, "points": "inputs", "of": "loss"},
    "intermediate": {"weight": 0.01, "points": "activations", "of": "loss"},
    "jacobian": {"weight": 0.01, "points": "inputs", "projection": "orthonormal"},
    "param_grad_norm": {"weight": 0.01, "power": 1.0, "points": "parameters", "of": "loss"},
    "path_length": {"weight": 2.0, "target": "ema", "ema_decay": 0.01, "projection": "gaussian",
                    "points": "latents"},
    "derivative": {"weight": 0.01, "order": 2, "points": "inputs"},
    "approx_r1": {"weight": 10.0, "gain": 0.5, "points": "real", "method": "perturbation"},
    "approx_r2": {"weight": 10.0, "gain": 0.5, "points": "fake", "method": "perturbation"},
    "max_gp": {"weight": 1.0, "points": "interpolates", "reduction": "max"},
    "spectral": {"weight": 0.01, "points": "inputs", "kind": "spectral", "iterations": 10},
    "hessian": {"weight": 0.1, "points": "latents", "kind": "hessian", "reduction": "max",
                "method": "finite_difference"},
}

#: The formula of each preset, for its function's docstring.
FORMULAS = {
    "wgan_gp": "λ mean_i (‖∇D(x̂_i)‖ − 1)² at interpolates x̂ (Gulrajani et al. 2017)",
    "wgan_lp": "λ mean_i max(0, ‖∇D(x̂_i)‖ − 1)² at interpolates x̂ (Petzka et al. 2018)",
    "r1": "γ/2 mean_i ‖∇D(x_i)‖² at the reals (Mescheder et al. 2018)",
    "r2": "γ/2 mean_i ‖∇D(x̃_i)‖² at the fakes (Mescheder et al. 2018)",
    "dragan": "λ mean_i (‖∇D(x̃_i)‖ − 1)² at perturbed reals x̃ (Kodali et al. 2017)",
    "double_backprop": "λ mean_i ‖∇_x loss_i‖² at the inputs (Drucker & LeCun 1992)",
    "intermediate": "λ mean_i ‖∇_h loss_i‖² at the named activations h (``layers=[...]``)",
    "jacobian": "λ mean_i ‖J_i‖_F², by random orthonormal projections (Hoffman et al. 2019)",
    "param_grad_norm": "λ ‖∇_θ loss‖ over all parameters (Zhao, Zhang & Hu 2022)",
    "path_length": "w mean_i (‖J_wᵀ y‖ − a)², a the running mean (Karras et al. 2020)",
    "derivative": "λ mean_i ‖∂ⁿ y/∂xⁿ‖² at the inputs, n = ``order``",
    "approx_r1": "γ/2 mean_i ‖D(x_i + σε_i) − D(x_i)‖²/σ² at the reals, ε ~ N(0, I): R1 without "
                 "a double backward, the same γ (Lin et al. 2025, rescaled); call it with the "
                 "critic itself, ``penalty(D, x)``",
    "approx_r2": "γ/2 mean_i ‖D(x̃_i + σε_i) − D(x̃_i)‖²/σ² at the fakes: R2 without a double "
                 "backward, the same γ; ``penalty(D, x̃)``",
    "max_gp": "λ max_i ‖∇D(x̂_i)‖² at interpolates x̂ (StudioGAN's Max-GP)",
    "spectral": "λ mean_i σ_max(∂f(x_i)/∂x_i)² by power iteration (``iterations``), or a "
                "Lipschitz target c with ``target=c, one_sided=True``; ``penalty(f, x)``",
    "hessian": "λ max (or mean) over samples and output units of Var_v(vᵀH v), v Rademacher, "
               "``count`` directions (Peebles et al. 2020); ``penalty(G, z)``",
}

_OPTIONS = ("weight", *PenaltyConfig.options())


def make_penalty(name: str, **overrides: Any) -> GradientPenalty:
    r"""The preset ``name`` with ``overrides`` applied, e.g. ``make_penalty("r1", weight=1.0)``.

    Examples:
        R1, :math:`\frac{\gamma}{2} \mathrm{mean}_i \lVert \nabla D(x_i) \rVert^2`, of a linear
        critic :math:`D(x) = w \cdot x` with :math:`\lVert w \rVert^2 = 25`:

        >>> import torch
        >>> from gradreg.penalties import as_points, make_penalty
        >>> w = torch.tensor([3.0, 4.0])
        >>> x = as_points(torch.randn(5, 2))
        >>> make_penalty("r1", weight=1.0)(x @ w, x)  # 1/2 * 25
        tensor(12.5000)
    """
    if name not in PRESETS:
        raise ValueError(f"unknown penalty preset {name!r}; known presets: {', '.join(PRESETS)}.")
    check_renamed(overrides)
    unknown = sorted(set(overrides) - set(_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for penalty {name!r}; valid: {', '.join(_OPTIONS)}."
        )
    return GradientPenalty(**{**PRESETS[name], **overrides})


def _preset(name: str) -> Callable[..., GradientPenalty]:
    """The function ``name(weight=<default>, **options)`` that builds the preset ``name``."""
    default = PRESETS[name]["weight"]

    def build(*args: float, **options: Any) -> GradientPenalty:
        if len(args) > 1:
            raise TypeError(
                f"{name}() takes the weight as its only positional argument "
                f"({name}(weight={default}, **options), e.g. {name}(0.1, every=16)); got "
                f"{len(args)} positional arguments {args}: pass the other options by name."
            )
        if args and "weight" in options:
            raise TypeError(f"{name}() got the weight twice: {args[0]} positionally and "
                            f"weight={options['weight']}.")
        return make_penalty(name, **dict(zip(("weight",), args, strict=False)), **options)

    build.__name__ = build.__qualname__ = name
    options = {"target": 0.0, "every": 1, **PRESETS[name]}
    layers = ", layers=['act1']" if options["points"] == "activations" else ""  # its own input
    build.__doc__ = (
        f"The ``{name}`` preset: {FORMULAS[name]}.\n\n"
        f"``weight`` (default {default}) may be passed positionally; every other option of "
        f":class:`GradientPenalty` by keyword. Preset options: {PRESETS[name]}.\n\n"
        f"Examples:\n"
        f"    >>> from gradreg.penalties import {name}\n"
        f"    >>> {name}({layers[2:]})\n"
        f"    GradientPenalty(weight={default}, target={options['target']}, "
        f"points={options['points']!r}, every={options['every']})\n"
        f"    >>> penalty = {name}(0.5, every=4{layers})\n"
        f"    >>> penalty.weight, penalty.every\n"
        f"    (0.5, 4)\n"
    )
    build.__signature__ = inspect.Signature([
        inspect.Parameter("weight", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                          annotation=float),
        inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD, annotation=Any),
    ], return_annotation=GradientPenalty)
    return build


wgan_gp = _preset("wgan_gp")
wgan_lp = _preset("wgan_lp")
r1 = _preset("r1")
r2 = _preset("r2")
dragan = _preset("dragan")
double_backprop = _preset("double_backprop")
intermediate = _preset("intermediate")
jacobian = _preset("jacobian")
param_grad_norm = _preset("param_grad_norm")
path_length = _preset("path_length")
derivative = _preset("derivative")
approx_r1 = _preset("approx_r1")
approx_r2 = _preset("approx_r2")
max_gp = _preset("max_gp")
spectral = _preset("spectral")
hessian = _preset("hessian")
