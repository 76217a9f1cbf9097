"""Kill a run after a checkpoint, resume from it: exactly the uninterrupted run's parameters,
penalty buffers, weight schedule and metrics.

The GAN exercises every piece of state: WGAN-GP interpolation coefficients and path-length
projections (global RNG), a lazy R1 (``every=2``: the penalty's step counter), the path-length
running mean (buffer), the critic-step counter (n_critic), a penalty-weight schedule (callback
state), and a shuffled loader (its epoch order is drawn from the global RNG). The killed run
is a child process that exits hard in the middle of epoch 3, after the epoch-2 checkpoint is
on disk.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning_cases import max_difference, parameters
from resume_run import fit


def killed_run(directory: Path) -> Path:
    """The run in a child process that dies mid-epoch; returns the last checkpoint it left."""
    script = Path(__file__).with_name("resume_run.py")
    child = subprocess.run([sys.executable, str(script), str(directory)], check=False,
                           capture_output=True, text=True)
    assert child.returncode == 17, child.stderr[-2000:]
    checkpoints = sorted(p.name for p in directory.glob("*.ckpt"))
    assert checkpoints == ["epoch=0-step=9.ckpt", "epoch=1-step=18.ckpt"], checkpoints
    return directory / checkpoints[-1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory):
    return fit(tmp_path_factory.mktemp("uninterrupted"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return killed_run(tmp_path_factory.mktemp("killed"))


def test_resume_after_kill_is_exact(uninterrupted, checkpoint: Path, tmp_path: Path) -> None:
    model, metrics = uninterrupted
    resumed, resumed_metrics = fit(tmp_path, ckpt_path=checkpoint)
    state, resumed_state = parameters(model), parameters(resumed)
    assert max_difference(state, resumed_state) == 0.0
    for name in ("penalties.r1.lazy_step", "penalties.pl.ema", "critic_steps"):
        assert torch.equal(state[name], resumed_state[name]), name
    assert model.penalties.gp.weight == resumed.penalties.gp.weight == 10.0
    assert metrics.keys() == resumed_metrics.keys() and metrics == resumed_metrics
    assert "val/energy_distance" in metrics


def test_resume_without_random_state_diverges(uninterrupted, checkpoint: Path,
                                              tmp_path: Path) -> None:
    """The control: without RandomState the draws after the resume differ (Lightning does not
    restore the RNG), so the exact match above is RandomState's doing."""
    model, _ = uninterrupted
    resumed, _ = fit(tmp_path, ckpt_path=checkpoint, random_state=False)
    assert max_difference(parameters(model), parameters(resumed)) > 1e-6
