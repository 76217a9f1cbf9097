"""Tiny float64 models and the evaluation of every preset on them, shared by the penalty tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

import gradreg
from gradreg.penalties import GradientPenalty, as_points, interpolate, perturb_dragan

CRITIC_PRESETS = ("wgan_gp", "wgan_lp", "r1", "r2", "dragan")
CLASSIFIER_PRESETS = ("double_backprop", "intermediate", "jacobian", "param_grad_norm",
                      "derivative")
ALL_PRESETS = (*CRITIC_PRESETS, *CLASSIFIER_PRESETS, "path_length")
#: Presets with their own tests (test_catalogue_presets.py; sam, asam: test_two_pass.py; gr:
#: methods/test_param_grad_norm.py): they run the model themselves or reduce by a maximum, so
#: the shared cases above (tensor outputs, micro-batch means) do not fit.
CATALOGUE_PRESETS = ("approx_r1", "approx_r2", "max_gp", "spectral", "hessian", "sam", "asam",
                     "gr")


def mlp(n_in: int, n_out: int, hidden: int = 6) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out)).double()


Run = Callable[[GradientPenalty, nn.Module, dict[str, Tensor]], Tensor]


def preset_case(name: str) -> tuple[nn.Module, Run]:
    """A model and a closure ``(penalty, model, params) -> penalty value`` that evaluates the model
    with ``params`` (``functional_call``, so gradcheck can vary them) on the points the preset asks
    for (``penalty.config.points``), with all randomness seeded inside the closure."""
    torch.manual_seed(0)
    real, fake = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 3, 1])
    if name in CRITIC_PRESETS:
        model = mlp(3, 1)
        with torch.no_grad():  # input-gradient norms on both sides of 1 (WGAN-LP is one-sided)
            model[2].weight.mul_(4)

        def run(penalty: GradientPenalty, critic: nn.Module, params: dict) -> Tensor:
            torch.manual_seed(1)
            points = {"real": as_points(real), "fake": as_points(fake),
                      "interpolates": interpolate(real, fake),
                      "perturbed": perturb_dragan(real)}[penalty.config.points]
            return penalty(functional_call(critic, params, (points,)), points)

        return model, run
    if name == "path_length":
        model = mlp(2, 6)

        def run(penalty: GradientPenalty, generator: nn.Module, params: dict) -> Tensor:
            torch.manual_seed(1)
            latents = torch.randn(5, 2, dtype=torch.float64).requires_grad_()
            return penalty(functional_call(generator, params, (latents,)), latents)

        return model, run
    model = mlp(3, 4)

    def run(penalty: GradientPenalty, classifier: nn.Module, params: dict) -> Tensor:
        torch.manual_seed(1)
        x = as_points(real)
        if penalty.config.points == "activations":
            with gradreg.capture(classifier, *penalty.config.layers) as acts:
                logits = functional_call(classifier, params, (x,))
                losses = F.cross_entropy(logits, labels, reduction="none")
            return penalty(losses, list(acts.values()))
        logits = functional_call(classifier, params, (x,))
        if penalty.config.points == "parameters":
            return penalty(F.cross_entropy(logits, labels), list(params.values()))
        if penalty.config.of == "outputs":
            return penalty(logits, x)
        return penalty(F.cross_entropy(logits, labels, reduction="none"), x)

    return model, run


def preset_kwargs(name: str) -> dict:
    return {"layers": ["1"]} if name == "intermediate" else {}


@pytest.fixture(params=ALL_PRESETS)
def preset(request: pytest.FixtureRequest) -> str:
    return request.param
