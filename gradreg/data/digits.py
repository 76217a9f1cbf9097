"""scikit-learn's bundled 8x8 digits (1,797 images, 10 classes) as a data module, offline."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

from gradreg.data.splits import SplitDataModule


class DigitsDataModule(SplitDataModule):
    """The digits as ``(x, y)`` batches, ``x`` in [0, 1] (raw values 0..16 divided by 16).

    ``shape`` is the shape of one sample: ``(64,)`` (flat vectors, for an MLP) or ``(1, 8, 8)``
    (images, for a CNN). The split is a fixed permutation drawn from ``seed``: the first
    ``test_fraction`` of it is the test set, the next ``val_fraction`` the validation set, the
    rest the training set; the same seed always gives the same split.
    """

    num_classes = 10

    def __init__(
        self,
        *,
        shape: Sequence[int] = (1, 8, 8),
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers)
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != 64:
            raise ValueError(f"data.shape={list(shape)} must hold 64 pixels: [64] or [1, 8, 8]")
        if min(val_fraction, test_fraction) <= 0 or val_fraction + test_fraction >= 1:
            raise ValueError("data.val_fraction and data.test_fraction must be > 0, sum < 1")
        self.save_hyperparameters()
        digits = load_digits()
        x = torch.as_tensor(digits.data, dtype=torch.float32).div_(16.0).reshape(-1, *shape)
        y = torch.as_tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
        n_test, n_val = round(test_fraction * len(y)), round(val_fraction * len(y))
        parts = order.split([n_test, n_val, len(y) - n_test - n_val])
        self.splits = {
            split: TensorDataset(x[idx], y[idx])
            for split, idx in zip(("test", "val", "train"), parts, strict=True)
        }
