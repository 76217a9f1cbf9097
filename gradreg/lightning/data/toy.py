"""Two-dimensional toy distributions, generated from a seed (no files, no downloads).

The mixtures follow the toy experiments of Gulrajani et al. 2017 (WGAN-GP, `gan_toy.py`):

* ``8gaussians``: 8 modes on a circle, ``mu_k = 2 (cos(k pi/4), sin(k pi/4)) / 1.414``,
  standard deviation ``0.02 / 1.414``.
* ``25gaussians``: a 5x5 grid, ``mu_ij = 2 (i, j) / 2.828`` for ``i, j in {-2..2}``, standard
  deviation ``0.05 / 2.828``.
* ``swissroll``: ``t = 1.5 pi (1 + 2u)``, ``x = (t cos t, t sin t) + 0.25 eps``, scaled by 1/7.5
  (scikit-learn's ``make_swiss_roll`` in the x-z plane, as in the reference code).
* ``moons``: two interleaving half circles with Gaussian noise (scikit-learn's ``make_moons``),
  labelled 0/1, for classifiers.

Every sampler returns ``(x, y)``: ``x`` of shape [n, 2] and ``y`` of shape [n], the mixture
component for the Gaussian mixtures, the moon for ``moons`` and 0 for the swiss roll.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from gradreg.lightning.data.splits import SplitDataModule

Sampler = Callable[[int, torch.Generator], tuple[Tensor, Tensor]]


def _circle_centers() -> Tensor:
    angles = torch.arange(8, dtype=torch.float64) * (math.pi / 4)
    return 2.0 * torch.stack([angles.cos(), angles.sin()], dim=1) / 1.414


def _grid_centers() -> Tensor:
    steps = torch.arange(-2, 3, dtype=torch.float64)
    return 2.0 * torch.cartesian_prod(steps, steps) / 2.828


# name -> (centers [K, 2], standard deviation of every component)
MIXTURES: dict[str, tuple[Tensor, float]] = {
    "8gaussians": (_circle_centers(), 0.02 / 1.414),
    "25gaussians": (_grid_centers(), 0.05 / 2.828),
}


def _mixture(name: str) -> Sampler:
    centers, sigma = MIXTURES[name]

    def sample(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        y = torch.randint(len(centers), (n,), generator=generator)
        noise = torch.randn(n, 2, generator=generator, dtype=torch.float64)
        return (centers[y] + sigma * noise).float(), y

    return sample


def _swissroll(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    t = 1.5 * math.pi * (1 + 2 * torch.rand(n, generator=generator, dtype=torch.float64))
    x = torch.stack([t * t.cos(), t * t.sin()], dim=1)
    x = x + 0.25 * torch.randn(n, 2, generator=generator, dtype=torch.float64)
    return (x / 7.5).float(), torch.zeros(n, dtype=torch.long)


def _moons(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    y = torch.randint(2, (n,), generator=generator)
    angle = math.pi * torch.rand(n, generator=generator, dtype=torch.float64)
    upper = torch.stack([angle.cos(), angle.sin()], dim=1)
    lower = torch.stack([1 - angle.cos(), 0.5 - angle.sin()], dim=1)
    x = torch.where(y[:, None] == 0, upper, lower)
    x = x + 0.1 * torch.randn(n, 2, generator=generator, dtype=torch.float64)
    return x.float(), y


TOY_SETS: dict[str, Sampler] = {
    "8gaussians": _mixture("8gaussians"),
    "25gaussians": _mixture("25gaussians"),
    "swissroll": _swissroll,
    "moons": _moons,
}


def sample_toy(name: str, n: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``n`` samples ``(x [n, 2], y [n])`` of the toy set ``name``, the same for the same seed."""
    if name not in TOY_SETS:
        raise ValueError(f"unknown toy data set {name!r}; valid values: {sorted(TOY_SETS)}")
    return TOY_SETS[name](n, torch.Generator().manual_seed(seed))


class ToyDataModule(SplitDataModule):
    """A toy set as fixed train/val/test splits drawn with seeds ``seed``, ``seed+1``, ``seed+2``.

    Batches are ``(x, y)`` as returned by :func:`sample_toy`.
    """

    def __init__(
        self,
        name: str = "8gaussians",
        *,
        n_train: int = 10_000,
        n_val: int = 2_000,
        n_test: int = 2_000,
        batch_size: int = 256,
        seed: int = 0,
        num_workers: int = 0,
        global_batch: bool = False,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers,
                         global_batch=global_batch, shuffle_seed=seed)
        if name not in TOY_SETS:
            raise ValueError(f"data.name={name!r} is unknown; valid values: {sorted(TOY_SETS)}")
        self.save_hyperparameters()
        self.name = name
        sizes = {"train": n_train, "val": n_val, "test": n_test}
        self.splits = {
            split: TensorDataset(*sample_toy(name, n, seed=seed + i))
            for i, (split, n) in enumerate(sizes.items())
        }
