"""ShardedPenaltyStrategy's refusals, in one process (its training runs on 2 ranks in
tests/reliability/test_fsdp.py and tests/app/test_train_fsdp.py)."""

from __future__ import annotations

import lightning as L
import pytest
from torch import nn

from gradreg import GradientError, sharding
from gradreg.lightning.compat import data_parallel_over_all_ranks
from gradreg.lightning.sharded import ShardedPenaltyStrategy


def test_a_module_without_the_named_submodules_is_refused() -> None:
    model = L.LightningModule()
    model.net = nn.Linear(2, 1)
    strategy = ShardedPenaltyStrategy(modules=["critic"])
    with pytest.raises(ValueError, match=r"shards the submodules \['critic'\].*strategy.modules"):
        strategy._configure_model(model)


def test_torch_without_public_fsdp2_is_refused_when_fitting_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sharding, "supports_exact_step", lambda: False)
    strategy = ShardedPenaltyStrategy()  # the app's trainer builds on any torch
    with pytest.raises(GradientError, match=r"needs torch >= 2\.6.*trainer=ddp_cpu"):
        strategy.connect(L.LightningModule())


def test_the_data_parallel_size_it_sets_is_lightnings() -> None:
    """``ModelParallelStrategy._data_parallel_size`` (private; gradreg.lightning.compat)."""
    strategy = ShardedPenaltyStrategy()
    assert strategy._data_parallel_size == "auto", (
        f"Lightning {L.__version__} keeps no ModelParallelStrategy._data_parallel_size: update "
        "gradreg/lightning/compat.py")
    strategy.num_nodes, strategy.parallel_devices = 2, ["cpu", "cpu", "cpu"]
    data_parallel_over_all_ranks(strategy)
    assert strategy._data_parallel_size == 6
