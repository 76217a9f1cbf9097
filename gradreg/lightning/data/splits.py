"""A data module over fixed train/val/test splits, and the seeded split itself."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import lightning as L
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    Sampler,
    SequentialSampler,
)


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


class SeededShuffle(Sampler[int]):
    """A random order of ``range(n)`` drawn from ``seed + epoch`` alone (not from the global
    random state), the same in every process; Lightning sets the epoch (``set_epoch``)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())

    def __len__(self) -> int:
        return self.n


class RankSlices(Sampler[list[int]]):
    r"""The batches of ``batches``, each cut into ``world`` contiguous slices (sizes differing by
    at most one), of which this sampler yields slice ``rank``: the ranks together see exactly the
    batches of one process, in its order.

    DDP averages the ranks' gradients with equal weights, which is the gradient of the whole batch
    only when the slices are equal. A batch of :math:`N` samples that does not divide (the last
    one of an epoch, e.g. digits: 1257 = 19 x 64 + 41 gives slices of 20 and 21) needs each
    rank's loss, a mean over its :math:`n_r` samples, scaled by :math:`w_r = n_r W / N`:

    .. math::

        \frac1W \sum_r w_r \frac1{n_r} \sum_{i \in r} g_i = \frac1N \sum_i g_i.

    ``weights`` holds :math:`w_r` of every slice yielded and not yet trained on, oldest first
    (a loader may fetch ahead); :class:`~gradreg.lightning.global_batch.GlobalBatchDDPStrategy`
    takes one per training step. A slice that would be empty (a last batch of fewer than ``world``
    samples) is the batch's first sample with weight 0: the rank still takes part in DDP's
    gradient all-reduce, with no effect on it.
    """

    def __init__(self, batches: BatchSampler, rank: int, world: int) -> None:
        self.batches, self.rank, self.world = batches, rank, world
        self.weights: deque[float] = deque()

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batches.sampler, "set_epoch"):
            self.batches.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        self.weights.clear()  # a new pass over the data: what an earlier pass fetched is gone
        for batch in self.batches:
            start = len(batch) * self.rank // self.world
            stop = len(batch) * (self.rank + 1) // self.world
            self.weights.append((stop - start) * self.world / len(batch))
            yield batch[start:stop] if stop > start else batch[:1]

    def __len__(self) -> int:
        return len(self.batches)


class SplitDataModule(L.LightningDataModule):
    """Serves ``self.splits["train" | "val" | "test"]``; only the training split is shuffled.

    Subclasses fill ``self.splits`` in ``__init__``: the data sets here are small, built from a
    seed and need no download, so there is nothing to prepare per process.

    Under DDP, ``batch_size`` is per rank by default (Lightning's ``DistributedSampler`` gives
    each rank its own shuffled share of the data, so W ranks train on batches of W x
    ``batch_size``). With ``global_batch=True`` it is the batch of a whole step, and the training
    order is drawn from ``shuffle_seed`` and the epoch alone (:class:`SeededShuffle`): every rank
    draws that order and takes its contiguous 1/W of each batch (:class:`RankSlices`), so W ranks
    train on exactly the batches that one process with ``global_batch=True`` trains on. The
    trainer needs ``use_distributed_sampler=False`` (the app sets it), and ``batch_size`` must be
    a multiple of W, and the strategy must weight the ranks' slices of a batch that does not
    divide (:class:`~gradreg.lightning.global_batch.GlobalBatchDDPStrategy`). Validation and test
    run whole on every rank.
    """

    splits: dict[str, Dataset]

    def __init__(self, *, batch_size: int, num_workers: int = 0, global_batch: bool = False,
                 shuffle_seed: int = 0) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.global_batch = global_batch
        self.shuffle_seed = shuffle_seed

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        options = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        trainer = self.trainer
        world = 1 if trainer is None else trainer.world_size
        if split == "train" and self.global_batch:
            if self.batch_size % world:
                raise ValueError(
                    f"batch_size={self.batch_size} is the global batch (global_batch=True) and "
                    f"must be a multiple of the {world} ranks")
            if world > 1 and not getattr(trainer.strategy, "weights_global_batches", False):
                raise ValueError(
                    f"global_batch=True on {world} ranks needs a strategy that weights the ranks' "
                    "slices of each batch (DDP's plain mean is wrong for a last batch that does "
                    "not divide): strategy=gradreg.lightning.global_batch.GlobalBatchDDPStrategy()")
            data = self.splits[split]
            order = SeededShuffle(len(data), self.shuffle_seed) if shuffle else None
            batches = BatchSampler(order or SequentialSampler(data), self.batch_size,
                                   drop_last=False)
            rank = 0 if trainer is None else trainer.global_rank
            return DataLoader(data, batch_sampler=RankSlices(batches, rank, world), **options)
        return DataLoader(self.splits[split], batch_size=self.batch_size, shuffle=shuffle,
                          **options)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
