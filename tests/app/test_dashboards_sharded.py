"""The classifier's dashboards under ``trainer=fsdp_cpu`` (2 processes, FSDP2-sharded parameters):
the gradient histograms hold each layer's whole gradient, gathered from its shards."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing import event_accumulator as ea

from gradreg.sharding import supports_exact_step

from .helpers import run_script


@pytest.mark.skipif(not supports_exact_step(), reason="fully_shard is public from 2.6")
@pytest.mark.slow
def test_sharded_gradients_are_gathered_whole_for_the_histograms(tmp_path: Path) -> None:
    """Before: ``.numpy() is not supported for tensor subclasses`` at the first histogram."""
    result = run_script("trainer=fsdp_cpu", "callbacks=dashboards", "trainer.max_epochs=1",
                        "+trainer.limit_train_batches=2", "+trainer.limit_val_batches=1",
                        "+trainer.limit_test_batches=1", "trainer.log_every_n_steps=1",
                        "callbacks.grad_split.every_n_steps=1",
                        "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    logged = ea.EventAccumulator(str(tmp_path),
                                 size_guidance={ea.HISTOGRAMS: 0}).Reload()
    # the digits MLP 64-128-128-10: fc1's weight has 128 x 64 entries, its bias 128
    counts = {tag: logged.Histograms(tag)[0].histogram_value.num
              for tag in ("param_grad/backbone.fc1", "param_grad_bias/backbone.fc1")}
    assert counts == {"param_grad/backbone.fc1": 8192, "param_grad_bias/backbone.fc1": 128}
    shares = [e.value for e in logged.Scalars("grad_split/penalty_share/backbone.fc1")]
    assert len(shares) == 2 and all(0 < share < 1 for share in shares)
