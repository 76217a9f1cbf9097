"""data.global_batch under DDP: the ranks together train on exactly the batches of one process."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, SequentialSampler

from gradreg import sharding
from gradreg.lightning.data import DigitsDataModule
from gradreg.lightning.data.splits import RankSlices
from gradreg.lightning.global_batch import check_splittable
from gradreg.penalties import make_penalty
from tests.distributed import run_processes


def test_rank_slices_cut_every_batch_into_contiguous_parts() -> None:
    batches = BatchSampler(SequentialSampler(range(11)), 4, drop_last=False)
    parts = [list(RankSlices(batches, rank, 2)) for rank in (0, 1)]
    assert parts == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9, 10]]]
    assert len(RankSlices(batches, 0, 2)) == 3


def test_uneven_slices_are_weighted_by_their_sample_counts() -> None:
    """w_r = n_r W / N: the last batch of the digits (41 samples) is cut 20/21 and weighted
    40/41 and 42/41, so that DDP's mean of the two ranks' gradients is the batch mean."""
    rank0, rank1 = (RankSlices(BatchSampler(SequentialSampler(range(1257)), 64, False), rank, 2)
                    for rank in (0, 1))
    assert [len(b) for b in rank0][-1:] == [20] and [len(b) for b in rank1][-1:] == [21]
    assert list(rank0.weights) == [1.0] * 19 + [40 / 41]
    assert list(rank1.weights) == [1.0] * 19 + [42 / 41]


def test_an_empty_slice_is_a_sample_of_weight_zero() -> None:
    """Before: batch_size=8 under DDP crashed at the end of the digits' epoch (1257 = 157 x 8 + 1:
    rank 0's slice of the last batch was empty). Now rank 0 still steps (DDP's all-reduce needs
    every rank) on one sample that weighs nothing; rank 1 carries the whole batch (weight 2)."""
    batches = BatchSampler(SequentialSampler(range(9)), 8, drop_last=False)
    rank0, rank1 = RankSlices(batches, 0, 2), RankSlices(batches, 1, 2)
    assert list(rank0) == [[0, 1, 2, 3], [8]] and list(rank0.weights) == [1.0, 0.0]
    assert list(rank1) == [[4, 5, 6, 7], [8]] and list(rank1.weights) == [1.0, 2.0]


def test_weights_are_taken_in_the_order_the_slices_were_fetched() -> None:
    """A loader fetches ahead of training: the strategy takes the oldest weight; a new pass over
    the data drops what the previous one left."""
    slices = RankSlices(BatchSampler(SequentialSampler(range(5)), 2, False), 0, 2)
    iterator = iter(slices)
    next(iterator), next(iterator)
    assert slices.weights.popleft() == 1.0 and list(slices.weights) == [1.0]
    assert len(list(slices)) == 3 and list(slices.weights) == [1.0, 1.0, 0.0]


def ddp(world: int, weights: bool = True) -> SimpleNamespace:
    return SimpleNamespace(weights_global_batches=weights) if world > 1 else SimpleNamespace()


def batches(module: DigitsDataModule, rank: int, world: int) -> list[torch.Tensor]:
    module.trainer = SimpleNamespace(world_size=world, global_rank=rank, strategy=ddp(world))
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
    module.trainer = SimpleNamespace(world_size=1, global_rank=0, strategy=ddp(1))
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


def test_global_batches_on_several_ranks_need_the_weighting_strategy() -> None:
    """Plain DDP would average an uneven last batch's slices 1/2-1/2 (4.4e-5 off one process
    after the digits' first epoch)."""
    module = DigitsDataModule(shape=(64,), batch_size=64, global_batch=True)
    module.trainer = SimpleNamespace(world_size=2, global_rank=0, strategy=ddp(2, False))
    with pytest.raises(ValueError, match="needs a strategy that weights .*GlobalBatchDDPStrategy"):
        module.train_dataloader()


def test_a_penalty_of_the_parameter_gradient_is_refused_with_accumulation() -> None:
    """Split over ranks it is the whole batch's (weighted slices); with accumulated
    micro-batches an uneven last window would be weighted otherwise than the task."""
    penalties = {"gnp": make_penalty("param_grad_norm", weight=0.1),
                 "db": make_penalty("double_backprop", weight=0.1)}
    with pytest.raises(ValueError, match="penalty 'gnp' .* accumulate_grad_batches=2"):
        check_splittable(penalties, 2, accumulate=2)
    check_splittable(penalties, 2)
    check_splittable(penalties, 1, accumulate=2)
    check_splittable({"db": penalties["db"]}, 2, accumulate=2)


@pytest.mark.parametrize("size", [0, -1, 2.5, True])
def test_batch_size_must_be_a_positive_integer(size: object) -> None:
    with pytest.raises(ValueError, match=f"batch_size must be an integer >= 1, got {size!r}"):
        DigitsDataModule(batch_size=size)


@pytest.mark.parametrize(("batch_size", "val_fraction", "steps", "penalty", "engine"), [
    (64, 0.15, 20, "double_backprop", "ddp"),  # the digits' epoch: 19 x 64 + 41, cut 20/21
    (8, 1462 / 1797, 9, "double_backprop", "ddp"),  # 65 = 8 x 8 + 1: rank 0's last slice empty
    # a penalty of the parameter gradient: 233 = 3 x 64 + 41, the last batch cut 20/21
    (64, 1294 / 1797, 4, "sam", "ddp"),
    (64, 1294 / 1797, 4, "param_grad_norm", "ddp"),
    # FSDP2 (the backbone sharded): the same weights of uneven slices
    pytest.param(64, 1294 / 1797, 4, "sam", "fsdp", marks=[pytest.mark.slow, pytest.mark.skipif(
        not sharding.supports_exact_step(), reason="FSDP2's public API: torch >= 2.6")]),
])
def test_two_ranks_with_global_batches_take_the_single_process_steps(
        tmp_path: Path, batch_size: int, val_fraction: float, steps: int, penalty: str,
        engine: str) -> None:
    """Real DDP or FSDP2 (2 gloo ranks): after a whole epoch of double backprop with Adam, the
    parameters are those of one process to float rounding (measured 1.5e-8 after the digits' 20
    steps, where an unweighted mean was 4.4e-5 off; 4.5e-8 after 158 steps of batch 8)."""
    root = Path(__file__).resolve().parents[3]
    for devices in (1, 2):
        ranks = [{"PYTHONPATH": str(root)}] if devices == 1 else [
            {"PYTHONPATH": str(root), "WORLD_SIZE": "2", "NODE_RANK": "0", "LOCAL_RANK": str(rank)}
            for rank in range(2)]
        run_processes([sys.executable, "-m", "tests.lightning.data.global_batch_run", str(devices),
                       str(tmp_path / f"{devices}.pt"), str(steps), str(batch_size),
                       str(val_fraction), penalty, engine], ranks, cwd=root)
    one, two = (torch.load(tmp_path / f"{d}.pt") for d in (1, 2))
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-6)
