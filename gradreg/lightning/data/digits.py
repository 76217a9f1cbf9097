"""scikit-learn's bundled 8x8 digits (1,797 images, 10 classes) as a data module, offline."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

from gradreg.lightning.data.splits import SplitDataModule, seeded_split


class DigitsDataModule(SplitDataModule):
    """The digits as ``(x, y)`` batches, ``x`` in [0, 1] (raw values 0..16 divided by 16).

    ``shape`` is the shape of one sample: ``(64,)`` (flat vectors, for an MLP), ``(1, 8, 8)``
    (images, for a CNN) or ``(1, S, S)`` with ``S > 8``: the images upsampled bilinearly to
    ``S x S`` (values stay in [0, 1]), e.g. 16x16 for the image GAN. The split is a fixed
    permutation drawn from ``seed``: the first ``test_fraction`` of it is the test set, the next
    ``val_fraction`` the validation set, the rest the training set (:func:`seeded_split`).
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
        global_batch: bool = False,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers,
                         global_batch=global_batch, shuffle_seed=seed)
        shape = tuple(int(s) for s in shape)
        if shape != (64,) and not (len(shape) == 3 and shape[0] == 1 and shape[1] == shape[2] >= 8):
            raise ValueError(f"data.shape={list(shape)} must be [64], [1, 8, 8] or [1, S, S] "
                             "with S > 8 (upsampled)")
        self.save_hyperparameters()
        digits = load_digits()
        x = torch.as_tensor(digits.data, dtype=torch.float32).div_(16.0)
        if len(shape) == 3 and shape[-1] > 8:
            x = F.interpolate(x.reshape(-1, 1, 8, 8), size=shape[1:], mode="bilinear")
        x = x.reshape(-1, *shape)
        y = torch.as_tensor(digits.target, dtype=torch.long)
        parts = seeded_split(len(y), val_fraction, test_fraction, seed)
        self.splits = {split: TensorDataset(x[idx], y[idx]) for split, idx in parts.items()}
