"""Gradient penalties: one mechanism (:class:`GradientPenalty`), the published ones as presets.

Plain PyTorch, WGAN-GP:

    >>> import torch
    >>> import gradreg
    >>> torch.manual_seed(0) and None
    >>> D = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1),
    ...                         torch.nn.Flatten(0))
    >>> real, fake = torch.randn(16, 2), torch.randn(16, 2) + 1
    >>> gp = gradreg.penalties.wgan_gp()                      # λ = 10
    >>> x_hat = gradreg.penalties.interpolate(real, fake)
    >>> loss = D(fake).mean() - D(real).mean() + gp(D(x_hat), x_hat)
    >>> loss.backward()
    >>> all(p.grad is not None for p in D.parameters())
    True
"""

from gradreg.penalties.accumulation import accumulated_backward
from gradreg.penalties.config import METHODS, PenaltyConfig
from gradreg.penalties.formulas.norms import per_sample_norm
from gradreg.penalties.formulas.options import Norm
from gradreg.penalties.kinds import GradientNorm, Hessian, Spectral
from gradreg.penalties.lazy import lazy_optimizer_kwargs
from gradreg.penalties.mechanism import POINTS, GradientPenalty, gradient_penalty
from gradreg.penalties.methods import DoubleBackward, FiniteDifference, ParameterShift, Perturbation
from gradreg.penalties.methods.param_gradient import LossAt
from gradreg.penalties.points import as_points, interpolate, perturb_dragan
from gradreg.penalties.presets import (
    PRESETS,
    approx_r1,
    approx_r2,
    asam,
    derivative,
    double_backprop,
    dragan,
    gr,
    hessian,
    intermediate,
    jacobian,
    make_penalty,
    max_gp,
    param_grad_norm,
    path_length,
    r1,
    r2,
    sam,
    spectral,
    wgan_gp,
    wgan_lp,
)
from gradreg.penalties.state.randomness import GeneratorState, SharedForward
from gradreg.penalties.terms import (
    EngineBackward,
    StepForward,
    StepTerms,
    Window,
    penalty_terms,
    step_terms,
)
from gradreg.penalties.two_pass import penalized_backward, penalized_loss

__all__ = [
    "METHODS",
    "POINTS",
    "PRESETS",
    "DoubleBackward",
    "EngineBackward",
    "FiniteDifference",
    "GeneratorState",
    "GradientNorm",
    "GradientPenalty",
    "Hessian",
    "LossAt",
    "Norm",
    "ParameterShift",
    "PenaltyConfig",
    "Perturbation",
    "SharedForward",
    "Spectral",
    "StepForward",
    "StepTerms",
    "Window",
    "accumulated_backward",
    "approx_r1",
    "approx_r2",
    "as_points",
    "asam",
    "derivative",
    "double_backprop",
    "dragan",
    "gr",
    "gradient_penalty",
    "hessian",
    "intermediate",
    "interpolate",
    "jacobian",
    "lazy_optimizer_kwargs",
    "make_penalty",
    "max_gp",
    "param_grad_norm",
    "path_length",
    "penalized_backward",
    "penalized_loss",
    "penalty_terms",
    "per_sample_norm",
    "perturb_dragan",
    "r1",
    "r2",
    "sam",
    "spectral",
    "step_terms",
    "wgan_gp",
    "wgan_lp",
]
