"""``trainer=ddp_cpu``: the GAN recipe with its dashboards (``callbacks=gan_dashboards``: every
callback, the HParams table's included) trains through scripts/train.py on 2 CPU processes;
only rank 0 writes TensorBoard (the DDP parity with one process is tested in
tests/reliability/test_ddp.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradreg import sharding

from .helpers import (
    LONG,
    TINY,
    check_two_process_gan_run,
    one_error_line,
    run_script,
    start,
    terminate_after,
)


@pytest.mark.slow
def test_gan_recipe_with_its_dashboards_trains_on_two_processes(tmp_path: Path) -> None:
    result = run_script("experiment=gan_8gaussians_wgan_gp", "callbacks=gan_dashboards",
                        "trainer=ddp_cpu", *TINY, f"hydra.run.dir={tmp_path}")
    check_two_process_gan_run(result, tmp_path)


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer=ddp_cpu", "penalty=param_grad_norm", "trainer.accumulate_grad_batches=2"],
     "error: data.global_batch: penalty 'param_grad_norm' (points='parameters') on global "
     "batches split over 2 ranks with accumulate_grad_batches=2"),
    pytest.param(["trainer=fsdp_cpu", "penalty=sam", "trainer.accumulate_grad_batches=2"],
                 "error: data.global_batch: penalty 'sam' (points='parameters') on global "
                 "batches split over 2 ranks with accumulate_grad_batches=2",
                 marks=pytest.mark.skipif(not sharding.supports_exact_step(),
                                          reason="FSDP2's public API: torch >= 2.6")),
])
def test_global_batches_that_two_ranks_cannot_split_exactly_are_one_line(
        tmp_path: Path, overrides: list[str], message: str) -> None:
    """A penalty of the parameter gradient with accumulated micro-batches (an uneven last
    window would be weighted otherwise than the task; without accumulation it is the whole
    batch's, tests/lightning/data/test_global_batch.py)."""
    result = run_script("data.global_batch=true", *overrides, *TINY, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith(message), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and result.stderr.count("error:") == 1


def test_sigterm_under_ddp_saves_the_run_on_every_rank_and_exits_143(tmp_path: Path) -> None:
    """Before: Lightning's SIGTERM handler broadcast from inside the signal handler, in the middle
    of a checkpoint's barrier: the ranks aborted ("Connection closed by peer") or hung. Now both
    ranks stop at the same step and rank 0 saves it (10 steps per epoch on 2 ranks)."""
    process = start("trainer=ddp_cpu", *LONG, f"hydra.run.dir={tmp_path}")
    stderr = terminate_after(process, "checkpoints/epoch0-*.ckpt", tmp_path)
    assert process.returncode == 143, stderr[-3000:]
    step = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    assert 10 <= step < 20  # within the epoch it was stopped in
    assert (f" step {step}: saved {tmp_path / 'checkpoints' / 'last.ckpt'}; resume with: python "
            "scripts/train.py trainer=ddp_cpu trainer.max_epochs=3") in one_error_line(stderr)
