"""Named configurations of :class:`GradientPenalty`: the published penalties, nothing more.

| preset            | formula                                             | points        |
|-------------------|-----------------------------------------------------|---------------|
| wgan_gp           | λ mean (‖∇D(x̂)‖ − 1)², x̂ interpolates              | interpolates  |
| wgan_lp           | λ mean max(0, ‖∇D(x̂)‖ − 1)²                         | interpolates  |
| r1 / r2           | γ/2 mean ‖∇D(x)‖² on reals / fakes                  | real / fake   |
| dragan            | λ mean (‖∇D(x̃)‖ − 1)², x̃ perturbed reals           | perturbed     |
| double_backprop   | λ mean ‖∇ₓ loss_i‖²                                 | inputs        |
| intermediate      | λ mean ‖∇_h loss_i‖² over named activations h       | activations   |
| jacobian          | λ mean ‖J‖_F², random orthonormal projections       | inputs        |
| param_grad_norm   | λ ‖∇θ loss‖                                         | parameters    |
| path_length       | w mean (‖J_wᵀ y‖ − a)², a an EMA, y ~ N(0, I)/√pix  | latents       |
| derivative        | λ mean ‖∂ⁿ y/∂xⁿ‖²                                  | inputs        |
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

from gradreg.penalties.mechanism import GradientPenalty

__all__ = ["PRESETS", "make_penalty"]

PRESETS: dict[str, dict[str, Any]] = {
    "wgan_gp": {"weight": 10.0, "target": 1.0, "points": "interpolates"},
    "wgan_lp": {"weight": 10.0, "target": 1.0, "one_sided": True, "points": "interpolates"},
    "r1": {"weight": 10.0, "gain": 0.5, "points": "real"},
    "r2": {"weight": 10.0, "gain": 0.5, "points": "fake"},
    "dragan": {"weight": 10.0, "target": 1.0, "points": "perturbed"},
    "double_backprop": {"weight": 1.0, "points": "inputs", "of": "loss"},
    "intermediate": {"weight": 1.0, "points": "activations", "of": "loss"},
    "jacobian": {"weight": 1.0, "points": "inputs", "projection": "orthonormal",
                 "num_projections": 1},
    "param_grad_norm": {"weight": 1.0, "power": 1.0, "points": "parameters", "of": "loss"},
    "path_length": {"weight": 2.0, "target": "ema", "ema_decay": 0.01, "projection": "gaussian",
                    "points": "latents"},
    "derivative": {"weight": 1.0, "order": 2, "points": "inputs"},
}

_OPTIONS = tuple(inspect.signature(GradientPenalty).parameters)


def make_penalty(name: str, **overrides: Any) -> GradientPenalty:
    """The preset ``name`` with ``overrides`` applied, e.g. ``make_penalty("r1", weight=1.0)``."""
    if name not in PRESETS:
        raise ValueError(f"unknown penalty preset {name!r}; known presets: {', '.join(PRESETS)}.")
    unknown = sorted(set(overrides) - set(_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for penalty {name!r}; valid: {', '.join(_OPTIONS)}."
        )
    return GradientPenalty(**{**PRESETS[name], **overrides})


wgan_gp = partial(make_penalty, "wgan_gp")
wgan_lp = partial(make_penalty, "wgan_lp")
r1 = partial(make_penalty, "r1")
r2 = partial(make_penalty, "r2")
dragan = partial(make_penalty, "dragan")
double_backprop = partial(make_penalty, "double_backprop")
intermediate = partial(make_penalty, "intermediate")
jacobian = partial(make_penalty, "jacobian")
param_grad_norm = partial(make_penalty, "param_grad_norm")
path_length = partial(make_penalty, "path_length")
derivative = partial(make_penalty, "derivative")
