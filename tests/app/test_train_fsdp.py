"""``trainer=fsdp_cpu``: the classifier and the GAN recipes train through scripts/train.py
with their networks sharded by FSDP2 over 2 CPU processes (the parity of the strategy with one
process is tested in tests/reliability/test_fsdp.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradreg.sharding import supports_exact_step

from .conftest import ROOT, SCRIPT
from .helpers import check_two_process_gan_run

TINY = ["trainer=fsdp_cpu", "trainer.max_epochs=1", "+trainer.limit_train_batches=4",
        "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1",
        "trainer.enable_progress_bar=false"]


@pytest.mark.skipif(not supports_exact_step(), reason="fully_shard is public from 2.6")
@pytest.mark.parametrize(("recipe", "metric"), [
    ([], "train/penalty/double_backprop"),  # the digits MLP classifier, double backprop
    # the GAN with WGAN-GP and its dashboards (its default callbacks=gan_dashboards)
    (["experiment=gan_8gaussians_wgan_gp"], "train/critic/wgan_gp"),
])
@pytest.mark.slow
def test_recipe_trains_sharded_on_two_processes(tmp_path: Path, recipe: list[str],
                                                metric: str) -> None:
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    result = subprocess.run([sys.executable, str(SCRIPT), *TINY, *recipe,
                             f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env, text=True,
                            capture_output=True, stdin=subprocess.DEVNULL, timeout=300)
    if recipe:
        check_two_process_gan_run(result, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Starting with 2 processes" in result.stdout + result.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics[metric] > 0 and all(math.isfinite(v) for v in metrics.values())
    checkpoints = list(tmp_path.rglob("*.ckpt"))
    assert checkpoints and all(c.is_file() for c in checkpoints)  # one file each, from rank 0
