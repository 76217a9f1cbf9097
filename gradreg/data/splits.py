"""A data module over fixed, in-memory train/val/test splits."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader, Dataset


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
