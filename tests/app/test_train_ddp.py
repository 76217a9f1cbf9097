"""``trainer=ddp_cpu``: the GAN recipe with its dashboards (``callbacks=gan_dashboards``: every
callback, the HParams table's included) trains through scripts/train.py on 2 CPU processes;
only rank 0 writes TensorBoard (the DDP parity with one process is tested in
tests/reliability/test_ddp.py)."""

from __future__ import annotations

from pathlib import Path

from .helpers import TINY, check_two_process_gan_run, run_script


def test_gan_recipe_with_its_dashboards_trains_on_two_processes(tmp_path: Path) -> None:
    result = run_script("experiment=gan_8gaussians_wgan_gp", "callbacks=gan_dashboards",
                        "trainer=ddp_cpu", *TINY, f"hydra.run.dir={tmp_path}")
    check_two_process_gan_run(result, tmp_path)
