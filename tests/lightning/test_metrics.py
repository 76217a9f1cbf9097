"""Evaluation metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from gradreg.data import MIXTURES
from gradreg.lightning.metrics import accuracy, energy_distance, fgsm, mode_metrics


def test_fgsm_steps_along_the_gradient_sign_and_clips() -> None:
    x = torch.tensor([[0.0, 0.5, 0.95, 0.3]])
    grad = torch.tensor([[-1.0, 2.0, 0.5, 0.0]])
    assert torch.allclose(fgsm(x, grad, 0.1, (0.0, 1.0)), torch.tensor([[0.0, 0.6, 1.0, 0.3]]))
    assert torch.allclose(fgsm(x, grad, 0.1), torch.tensor([[-0.1, 0.6, 1.05, 0.3]]))


def test_accuracy() -> None:
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]])
    assert float(accuracy(logits, torch.tensor([0, 1, 1, 1]))) == 0.75


def test_mode_metrics_on_known_samples() -> None:
    centers, sigma = MIXTURES["8gaussians"]
    # every center exactly, plus 2 samples far from all modes: 8 modes, 8/10 high quality
    samples = torch.cat([centers, torch.zeros(2, 2, dtype=centers.dtype)]).float()
    assert mode_metrics(samples, centers, sigma) == (8, pytest.approx(0.8))
    # all samples near one mode, one of them just outside 3 sigma
    near = centers[[3, 3, 3]] + torch.tensor([[0.0, 0.0], [2.9 * sigma, 0], [3.1 * sigma, 0]])
    assert mode_metrics(near, centers, sigma) == (1, pytest.approx(2 / 3))


def test_energy_distance_values() -> None:
    x = torch.tensor([[0.0], [2.0]])
    assert float(energy_distance(x, x)) == pytest.approx(0.0)
    # 2 E|X-Y| - E|X-X'| - E|Y-Y'| with X in {0, 2}, Y = 1: 2*1 - (0+2+2+0)/4 - 0 = 1
    assert float(energy_distance(x, torch.tensor([[1.0]]))) == pytest.approx(1.0)
    # N(0, I) against N((3, 3), I): by Jensen E|X-Y| >= |(3, 3)| and E|X-X'| <= sqrt(4) = 2
    rng = torch.Generator().manual_seed(0)
    x, y = torch.randn(400, 2, generator=rng), torch.randn(400, 2, generator=rng) + 3
    assert float(energy_distance(x, y)) > 2 * math.sqrt(18) - 2 - 2
