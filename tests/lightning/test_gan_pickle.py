"""A GAN (its loss terms included) pickles, as ``ddp_spawn`` needs to start its processes."""

import pickle

import torch

from gradreg.lightning.gan import GAN
from gradreg.models import MLP
from gradreg.penalties import presets


def test_a_gan_with_each_adversarial_loss_survives_pickling() -> None:
    real = torch.randn(4, 2)
    for loss in ("wgan", "nonsaturating", "relativistic"):
        torch.manual_seed(0)
        gan = GAN(MLP(2, 2, hidden=[8]), MLP(2, 1, hidden=[8]), {"r1": presets.r1(1.0)},
                  loss=loss, latent_dim=2)
        copy = pickle.loads(pickle.dumps(gan))
        torch.manual_seed(1)
        expected = gan.gan_loss.critic_terms(real)["adversarial"]
        torch.manual_seed(1)
        assert torch.equal(copy.gan_loss.critic_terms(real)["adversarial"], expected)
