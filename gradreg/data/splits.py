"""A data module over fixed train/val/test splits, and the seeded split itself."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


def seeded_split(n: int, val_fraction: float, test_fraction: float, seed: int
                 ) -> dict[str, torch.Tensor]:
    """Indices of a fixed permutation of ``range(n)`` drawn from ``seed``: the first
    ``round(test_fraction n)`` are the test split, the next ``round(val_fraction n)`` the
    validation split, the rest the training split; the same seed always gives the same split."""
    if min(val_fraction, test_fraction) <= 0 or val_fraction + test_fraction >= 1:
        raise ValueError("data.val_fraction and data.test_fraction must be > 0, sum < 1")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test, n_val = round(test_fraction * n), round(val_fraction * n)
    parts = order.split([n_test, n_val, n - n_test - n_val])
    return dict(zip(("test", "val", "train"), parts, strict=True))


class SplitDataModule(L.LightningDataModule):
    """Serves ``self.splits["train" | "val" | "test"]``; only the training split is shuffled.

    Subclasses fill ``self.splits`` in ``__init__``: the data sets here are small, built from a
    seed and need no download, so there is nothing to prepare per process.
    """

    splits: dict[str, Dataset]

    def __init__(self, *, batch_size: int, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        return DataLoader(
            self.splits[split],
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
