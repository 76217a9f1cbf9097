"""Evaluation metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from gradreg.evaluation.metrics import accuracy, energy_distance, fgsm, mode_metrics, pgd
from gradreg.lightning.data import MIXTURES


def test_fgsm_steps_along_the_gradient_sign_and_clips() -> None:
    x = torch.tensor([[0.0, 0.5, 0.95, 0.3]])
    grad = torch.tensor([[-1.0, 2.0, 0.5, 0.0]])
    assert torch.allclose(fgsm(x, grad, 0.1, (0.0, 1.0)), torch.tensor([[0.0, 0.6, 1.0, 0.3]]))
    assert torch.allclose(fgsm(x, grad, 0.1), torch.tensor([[-0.1, 0.6, 1.05, 0.3]]))


def test_pgd_reaches_the_corner_of_the_ball_for_a_linear_loss() -> None:
    """For L(x) = w.x the best L-inf attack is x + eps sign(w) (clipped); k steps of 2.5 eps / k
    get there from any random start, and a zero-gradient coordinate keeps its random start."""
    x = torch.tensor([[0.2, 0.5, 0.95, 0.3], [0.6, 0.1, 0.0, 0.7]])
    w = torch.tensor([1.0, -2.0, 0.5, 0.0])
    rng = torch.Generator().manual_seed(0)
    attacked = pgd(lambda q: (q * w).sum(), x, 0.1, steps=4, bounds=(0.0, 1.0), generator=rng)
    corner = (x + 0.1 * w.sign()).clamp(0, 1)
    assert torch.allclose(attacked[:, :3], corner[:, :3])
    start = 2 * torch.rand(x.shape, generator=torch.Generator().manual_seed(0)) - 1
    assert torch.allclose(attacked[:, 3], (x + 0.1 * start)[:, 3])  # random start, never moved


def test_pgd_stays_in_the_ball_and_bounds_and_is_seeded() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x, y = torch.rand(32, 5), torch.randint(3, (32,))

    def loss(q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(net(q), y, reduction="sum")

    runs = [pgd(loss, x, 0.05, steps=7, bounds=(0.0, 1.0),
                generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert float((runs[0] - x).abs().max()) <= 0.05 + 1e-7
    assert float(runs[0].min()) >= 0.0 and float(runs[0].max()) <= 1.0
    assert float(loss(runs[0]).detach()) > float(loss(x).detach())  # it ascended
    assert torch.equal(pgd(loss, x, 0.0, steps=3), x)
    with pytest.raises(ValueError, match="pgd steps must be an integer >= 1, got 0"):
        pgd(loss, x, 0.1, steps=0)


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
