"""data.global_batch under DDP: the ranks together train on exactly the batches of one process."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, SequentialSampler

from gradreg.data import DigitsDataModule
from gradreg.data.splits import RankSlices
from tests.distributed import run_processes


def test_rank_slices_cut_every_batch_into_contiguous_parts() -> None:
    batches = BatchSampler(SequentialSampler(range(11)), 4, drop_last=False)
    parts = [list(RankSlices(batches, rank, 2)) for rank in (0, 1)]
    assert parts == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9, 10]]]
    assert len(RankSlices(batches, 0, 2)) == 3


def batches(module: DigitsDataModule, rank: int, world: int) -> list[torch.Tensor]:
    module.trainer = SimpleNamespace(world_size=world, global_rank=rank)
    torch.manual_seed(7)  # every rank is seeded alike (seed_everything)
    return [x for x, _ in module.train_dataloader()]


def test_global_batches_sliced_over_two_ranks_are_the_single_process_batches() -> None:
    """The order comes from the data seed and the epoch, not from the global random state (which
    Lightning's DDP re-seeds after the model is built)."""
    module = DigitsDataModule(shape=(64,), batch_size=64, global_batch=True)
    single = batches(module, 0, 1)
    torch.manual_seed(123)  # another global state: the same order
    rank0, rank1 = batches(module, 0, 2), batches(module, 1, 2)
    assert len(single) == len(rank0) == len(rank1) == 20
    for whole, first, second in zip(single, rank0, rank1, strict=True):
        assert torch.equal(torch.cat([first, second]), whole)
    assert {len(x) for x in rank0[:-1]} == {32}


def test_the_global_batch_order_changes_with_the_epoch_lightning_sets() -> None:
    module = DigitsDataModule(shape=(64,), batch_size=64, global_batch=True)
    module.trainer = SimpleNamespace(world_size=1, global_rank=0)
    loader = module.train_dataloader()
    first = [y for _, y in loader]
    loader.batch_sampler.set_epoch(1)
    second = [y for _, y in loader]
    loader.batch_sampler.set_epoch(0)
    assert not torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first, [y for _, y in loader], strict=True))


def test_a_global_batch_must_divide_over_the_ranks() -> None:
    module = DigitsDataModule(shape=(64,), batch_size=63, global_batch=True)
    with pytest.raises(ValueError, match="batch_size=63 is the global batch .* multiple of the 2"):
        batches(module, 0, 2)


@pytest.mark.parametrize("size", [0, -1, 2.5, True])
def test_batch_size_must_be_a_positive_integer(size: object) -> None:
    with pytest.raises(ValueError, match=f"batch_size must be an integer >= 1, got {size!r}"):
        DigitsDataModule(batch_size=size)


def test_two_ranks_with_global_batches_take_the_single_process_steps(tmp_path: Path) -> None:
    """Real DDP (2 gloo ranks): after 3 steps of double backprop with Adam, the parameters are
    those of one process to float rounding (measured 1.5e-8)."""
    root = Path(__file__).resolve().parents[2]
    for devices in (1, 2):
        ranks = [{"PYTHONPATH": str(root)}] if devices == 1 else [
            {"PYTHONPATH": str(root), "WORLD_SIZE": "2", "NODE_RANK": "0", "LOCAL_RANK": str(rank)}
            for rank in range(2)]
        run_processes([sys.executable, "-m", "tests.data.global_batch_run", str(devices),
                       str(tmp_path / f"{devices}.pt")], ranks, cwd=root)
    one, two = (torch.load(tmp_path / f"{d}.pt") for d in (1, 2))
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-6)
