"""What PenaltyWeightSchedule counts: the steps of the optimizer the penalty belongs to. In the
GAN (manual optimization, n_critic critic steps per generator step) a critic penalty's ramp counts
critic steps and a generator penalty's generator steps, not Lightning's global step (both)."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradreg.lightning.callbacks import PenaltyWeightSchedule
from gradreg.lightning.gan import GAN
from gradreg.models import MLP
from gradreg.penalties import GradientPenalty, make_penalty

BATCH, BATCHES, N_CRITIC = 4, 12, 3


def recording(name: str) -> tuple[GradientPenalty, list[float]]:
    """The preset ``name`` and the list of the weights it is called with, one per step."""
    penalty, used = make_penalty(name), []
    penalty.register_forward_pre_hook(lambda module, args: used.append(module.weight))
    return penalty, used


def fit_gan(schedule: PenaltyWeightSchedule) -> tuple[list[float], list[float]]:
    """The weights WGAN-GP and path length were called with, per step of each."""
    torch.manual_seed(0)
    (gp, gp_used), (pl, pl_used) = recording("wgan_gp"), recording("path_length")
    module = GAN(MLP(2, 2, hidden=(8,), activation="tanh"), MLP(2, 1, hidden=(8,),
                                                                activation="tanh"),
                 {"gp": gp, "pl": pl}, n_critic=N_CRITIC, latent_dim=2,
                 generator_optimizer=partial(torch.optim.SGD, lr=1e-3),
                 critic_optimizer=partial(torch.optim.SGD, lr=1e-3))
    data = DataLoader(TensorDataset(torch.randn(BATCH * BATCHES, 2)), batch_size=BATCH)
    L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, limit_val_batches=0, inference_mode=False,
              callbacks=[schedule]).fit(module, data)
    return gp_used, pl_used


def test_a_critic_ramp_counts_critic_steps_and_a_generator_ramp_generator_steps() -> None:
    """12 batches = 12 critic steps and 4 generator steps (global_step 16). A linear ramp of 6
    steps from 0 to 1: the critic's weight at its step t is min(t / 6, 1) for t = 0..11 (it ends
    after exactly 6 critic steps; counting global steps ended it after 5); the generator's, at
    its steps t = 0..3, is t / 6."""
    schedule = PenaltyWeightSchedule("linear", start=0.0, end=1.0, steps=6)
    gp_used, pl_used = fit_gan(schedule)
    assert gp_used == pytest.approx([min(t / 6, 1.0) for t in range(12)])
    assert pl_used == pytest.approx([t / 6 for t in range(4)])
    assert schedule.optimizer_steps == {"penalties.gp": 11, "penalties.pl": 3}


class NoDue(GAN):
    """A manual-optimization module that never calls due(): nothing the schedule could count."""

    def training_step(self, batch: tuple, batch_idx: int) -> None:
        _, opt_critic = self.optimizers()
        opt_critic.zero_grad()
        loss = self.critic(batch[0]).mean()
        self.manual_backward(loss)
        opt_critic.step()


def test_a_manual_module_that_never_calls_due_is_an_error() -> None:
    torch.manual_seed(0)
    module = NoDue(MLP(2, 2, hidden=(8,)), MLP(2, 1, hidden=(8,)), {"gp": make_penalty("wgan_gp")},
                   n_critic=1, latent_dim=2)
    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0, inference_mode=False,
                        callbacks=[PenaltyWeightSchedule(steps=4)])
    with pytest.raises(ValueError, match=r"step counter of \['penalties.gp'\] did not advance.*"
                                         r"penalty.due\(\)"):
        trainer.fit(module, data)
