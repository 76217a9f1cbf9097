"""The digits split and the seeded toy sets: sizes, ranges, reproducibility, the known geometry."""

from __future__ import annotations

import math

import pytest
import torch
from sklearn.datasets import load_digits

from gradreg.lightning.data import MIXTURES, TOY_SETS, DigitsDataModule, ToyDataModule, sample_toy


def test_digits_split_is_fixed_disjoint_and_complete() -> None:
    data = DigitsDataModule(shape=(64,), seed=0)
    sizes = {split: len(ds) for split, ds in data.splits.items()}
    assert sizes == {"test": 270, "val": 270, "train": 1257}  # 15% / 15% / rest of 1,797
    x_all = torch.cat([ds.tensors[0] for ds in data.splits.values()])
    labels = torch.cat([ds.tensors[1] for ds in data.splits.values()])
    # the splits together are the whole set: every class count and the pixel sum agree
    assert torch.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert float(x_all.double().sum()) * 16 == float(load_digits().data.sum())
    assert float(x_all.min()) == 0.0 and float(x_all.max()) == 1.0  # raw 0..16 divided by 16


def test_digits_same_seed_same_split_and_shapes_agree() -> None:
    flat, image = DigitsDataModule(shape=(64,), seed=3), DigitsDataModule(shape=(1, 8, 8), seed=3)
    other = DigitsDataModule(shape=(64,), seed=4)
    x_flat, y_flat = flat.splits["train"].tensors
    x_image, y_image = image.splits["train"].tensors
    assert x_image.shape == (1257, 1, 8, 8)
    assert torch.equal(x_image.reshape(-1, 64), x_flat) and torch.equal(y_image, y_flat)
    assert not torch.equal(other.splits["train"].tensors[1], y_flat)


def test_digits_loaders_shuffle_only_training() -> None:
    data = DigitsDataModule(shape=(64,), batch_size=32)
    assert next(iter(data.val_dataloader()))[0].shape == (32, 64)
    assert torch.equal(next(iter(data.test_dataloader()))[1], data.splits["test"].tensors[1][:32])


@pytest.mark.parametrize("shape", [(2, 8), (1, 4, 4), (3, 16, 16), (1, 16, 12)])
def test_digits_rejects_other_shapes(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"data.shape=\[.*\] must be \[64\], \[1, 8, 8\] or"):
        DigitsDataModule(shape=shape)


def test_digits_upsampled_to_16x16_keep_range_split_and_mean() -> None:
    """Bilinear upsampling (no corner alignment) by 2 keeps [0, 1] and, away from the border
    (edge pixels are replicated), the mean of each image's interior 2x2 blocks."""
    small, large = DigitsDataModule(shape=(1, 8, 8)), DigitsDataModule(shape=(1, 16, 16))
    (x8, y8), (x16, y16) = small.splits["test"].tensors, large.splits["test"].tensors
    assert x16.shape == (270, 1, 16, 16) and torch.equal(y8, y16)
    assert float(x16.min()) >= 0.0 and float(x16.max()) <= 1.0
    # the bilinear weights are 1/4, 3/4 in each axis: each 2x2 block of the upsampled interior
    # averages to the mean of the 2x2 source neighbourhood with weights that sum to one
    blocks = x16[..., 1:15, 1:15].unfold(2, 2, 2).unfold(3, 2, 2).mean((-1, -2))
    neighbourhood = x8.unfold(2, 2, 1).unfold(3, 2, 1).mean((-1, -2))
    assert torch.allclose(blocks, neighbourhood, atol=1e-6)


@pytest.mark.parametrize("name", sorted(TOY_SETS))
def test_toy_sets_are_reproducible_from_the_seed(name: str) -> None:
    x, y = sample_toy(name, 500, seed=7)
    assert x.shape == (500, 2) and x.dtype == torch.float32 and y.shape == (500,)
    assert torch.equal(x, sample_toy(name, 500, seed=7)[0])
    assert not torch.equal(x, sample_toy(name, 500, seed=8)[0])


@pytest.mark.parametrize(("name", "modes", "radius"), [("8gaussians", 8, 2 / 1.414),
                                                       ("25gaussians", 25, 4 / 2.828)])
def test_mixtures_have_the_wgan_gp_geometry(name: str, modes: int, radius: float) -> None:
    centers, sigma = MIXTURES[name]
    assert len(centers) == modes
    assert math.isclose(float(centers.abs().max()), radius, rel_tol=1e-6)
    x, y = sample_toy(name, 4000)
    distance = (x.double() - centers[y]).norm(dim=1)
    # the distance of a 2D Gaussian sample to its mean is Rayleigh: P(r <= 3 sigma) = 0.989
    assert 0.98 < float((distance <= 3 * sigma).double().mean()) < 0.995
    assert set(y.tolist()) == set(range(modes))


def test_swissroll_and_moons_ranges() -> None:
    roll, _ = sample_toy("swissroll", 2000)
    # t in [1.5 pi, 4.5 pi]: |x| <= 4.5 pi / 7.5 = 1.885, plus noise of std 0.25/7.5
    assert float(roll.norm(dim=1).max()) < 1.885 + 5 * 0.25 / 7.5
    assert float(roll.norm(dim=1).min()) > 1.5 * math.pi / 7.5 - 5 * 0.25 / 7.5
    x, y = sample_toy("moons", 2000)
    assert set(y.tolist()) == {0, 1}
    assert float(x[y == 0, 1].mean()) > float(x[y == 1, 1].mean())  # upper moon above lower


def test_toy_data_module_splits_use_consecutive_seeds() -> None:
    data = ToyDataModule("8gaussians", n_train=100, n_val=50, n_test=20, batch_size=10, seed=5)
    assert [len(ds) for ds in data.splits.values()] == [100, 50, 20]
    assert torch.equal(data.splits["val"].tensors[0], sample_toy("8gaussians", 50, seed=6)[0])
    with pytest.raises(ValueError, match=r"'9gaussians' is unknown; valid values: \['25gauss"):
        ToyDataModule("9gaussians")
