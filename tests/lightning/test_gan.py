"""The GAN module against a straight-line WGAN-GP loop written here (same seeds, same parameters
after a few steps), its step counting across epochs, and its construction errors."""

from __future__ import annotations

import copy
import pickle
from functools import partial

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradreg.lightning.gan import GAN
from gradreg.lightning.gan_loss import GANLoss
from gradreg.models import MLP
from gradreg.penalties import interpolate, make_penalty, presets

BATCH, BATCHES, EPOCHS, N_CRITIC, LATENT = 8, 3, 2, 2, 2
ADAM = partial(torch.optim.Adam, lr=1e-2, betas=(0.5, 0.9))


def networks() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return (MLP(LATENT, 2, hidden=(16,), activation="tanh").double(),
            MLP(2, 1, hidden=(16,), activation="tanh").double())


def reals() -> torch.Tensor:
    return torch.randn(BATCHES * BATCH, 2, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)


@pytest.mark.parametrize("gp_options", [{}, {"chunks": 3}])
def test_steps_match_a_straight_line_reference_loop(gp_options: dict) -> None:
    """WGAN loss + WGAN-GP on the critic, lazy path length (every 2) on the generator, n_critic=2,
    two epochs of three batches: 6 critic steps and 3 generator steps (counted on critic steps:
    counting on batch_idx per epoch would give 4). With ``chunks`` the module's WGAN-GP is built
    micro-batch by micro-batch; the reference's is not: the same parameters."""
    generator, critic = networks()
    G, D = copy.deepcopy(generator), copy.deepcopy(critic)
    loader = DataLoader(TensorDataset(reals()), batch_size=BATCH)

    module = GAN(generator, critic, {"gp": make_penalty("wgan_gp", **gp_options),
                                     "pl": make_penalty("path_length", every=2)},
                 n_critic=N_CRITIC, latent_dim=LATENT, generator_optimizer=ADAM,
                 critic_optimizer=ADAM)
    trainer = L.Trainer(max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0, inference_mode=False)
    torch.manual_seed(123)
    trainer.fit(module, loader)

    # the reference: WGAN-GP's Algorithm 1 with StyleGAN2's lazy path length, written out
    torch.manual_seed(123)
    opt_g, opt_d = ADAM(G.parameters()), ADAM(D.parameters())
    gp, pl = make_penalty("wgan_gp"), make_penalty("path_length", every=2)
    critic_steps = generator_steps = 0
    for _ in range(EPOCHS):
        for (real,) in loader:
            fake = G(torch.randn(BATCH, LATENT, dtype=torch.float64)).detach()
            x_hat = interpolate(real, fake)
            loss_d = D(fake).mean() - D(real).mean() + gp(D(x_hat), x_hat)
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            critic_steps += 1
            if critic_steps % N_CRITIC == 0:
                z = torch.randn(BATCH, LATENT, dtype=torch.float64)
                loss_g = -D(G(z)).mean()
                if pl.due():  # lazy: generator steps 0, 2
                    w = z.detach().requires_grad_()
                    loss_g = loss_g + pl(G(w), w)
                opt_g.zero_grad()
                loss_g.backward()
                opt_g.step()
                generator_steps += 1

    assert (critic_steps, generator_steps) == (6, 3)
    assert int(module.critic_steps) == 6
    opt_generator, opt_critic = (opt.optimizer for opt in module.optimizers())
    assert int(opt_critic.state[critic.out.weight]["step"]) == 6
    assert int(opt_generator.state[generator.out.weight]["step"]) == 3
    for mine, theirs in [(generator, G), (critic, D)]:
        for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
            assert torch.allclose(p, q, atol=1e-10, rtol=0)
    assert not torch.allclose(next(G.parameters()), next(networks()[0].parameters()))


def test_validation_reports_modes_on_mixtures_only() -> None:
    generator, critic = (net.float() for net in networks())
    loader = DataLoader(TensorDataset(reals().float()), batch_size=BATCH)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, inference_mode=False)
    metrics = {
        dataset: trainer.validate(GAN(generator, critic, dataset=dataset), loader, verbose=False)[0]
        for dataset in ("8gaussians", "swissroll")
    }
    common = {"val/energy_distance", "val/wasserstein"}
    assert set(metrics["8gaussians"]) == common | {"val/modes", "val/high_quality"}
    assert set(metrics["swissroll"]) == common
    # the same fakes and reals: the same energy distance, > 0 (they differ)
    energy = metrics["8gaussians"]["val/energy_distance"]
    assert energy == metrics["swissroll"]["val/energy_distance"] and energy > 0.1
    # an untrained generator keeps N(0, I) latents near the origin, > 3 sigma from every mode
    assert metrics["8gaussians"]["val/modes"] == metrics["8gaussians"]["val/high_quality"] == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n_critic": 0}, r"n_critic must be an integer >= 1, got 0"),
    ({"loss": "hinge"},
     r"loss='hinge' is unknown; valid values: \['nonsaturating', 'relativistic', 'wgan'\]"),
    ({"dataset": "mnist"}, r"dataset='mnist' is unknown; valid values: \['25gaussians'"),
    ({"penalties": {"db": make_penalty("double_backprop")}},
     r"penalty 'db' has points='inputs', which a GAN cannot evaluate; a GAN supports points "
     r"\['real', 'fake', 'interpolates', 'perturbed', 'latents'\], i.e. the presets \['wgan_gp'"),
])
def test_construction_errors_name_the_option_and_the_valid_values(kwargs: dict,
                                                                  message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GAN(*networks(), **kwargs)


@pytest.mark.parametrize("options", [{}, {"chunks": 2}])
def test_r1_and_r2_against_straight_line_formulas(options: dict) -> None:
    """Non-saturating loss + R1 (gamma 3) + R2 (gamma 5): the terms and the critic's gradient
    against the formulas written out. By plain double backward the penalties reuse the
    adversarial forward (2 critic calls); with chunks they run their own (2 + 2 x 2 calls)."""
    generator, critic = networks()
    penalties = {"r1": make_penalty("r1", weight=3.0, **options),
                 "r2": make_penalty("r2", weight=5.0, **options)}
    gan_loss = GANLoss(generator, critic, penalties, adversarial="nonsaturating",
                       latent_dim=LATENT)
    calls = []
    hook = critic.register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(7)
    terms = gan_loss.critic_terms(reals()[:BATCH])
    hook.remove()
    assert len(calls) == (2 if not options else 6)
    params = list(critic.parameters())
    grads = torch.autograd.grad(sum(terms.values()), params)

    torch.manual_seed(7)
    fake = generator(torch.randn(BATCH, LATENT, dtype=torch.float64)).detach()
    real = reals()[:BATCH].requires_grad_()
    fake.requires_grad_()
    d_real, d_fake = critic(real).squeeze(1), critic(fake).squeeze(1)
    adversarial = (torch.nn.functional.softplus(d_fake)
                   + torch.nn.functional.softplus(-d_real)).mean()
    (g_real,) = torch.autograd.grad(d_real.sum(), real, create_graph=True)
    (g_fake,) = torch.autograd.grad(d_fake.sum(), fake, create_graph=True)
    r1 = 3.0 / 2 * g_real.square().sum(1).mean()
    r2 = 5.0 / 2 * g_fake.square().sum(1).mean()
    expected = torch.autograd.grad(adversarial + r1 + r2, params)
    for mine, theirs in [(terms["adversarial"], adversarial), (terms["r1"], r1),
                         (terms["r2"], r2)]:
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-12, atol=0)
    for mine, theirs in zip(grads, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def test_relativistic_pairing_loss_against_the_formulas() -> None:
    """RpGAN: critic softplus(D(G(z_i)) - D(x_i)), generator softplus(D(x_i) - D(G(z_i))), pairs
    by index; the generator phase scores the reals too (4 critic calls per step pair, not 3)."""
    generator, critic = networks()
    gan_loss = GANLoss(generator, critic, {}, adversarial="relativistic", latent_dim=LATENT)
    real = reals()[:BATCH]
    calls = []
    hook = critic.register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(3)
    critic_term = gan_loss.critic_terms(real)["adversarial"]
    generator_term = gan_loss.generator_terms(real)["adversarial"]
    hook.remove()
    assert len(calls) == 4
    torch.manual_seed(3)
    fake_critic = generator(torch.randn(BATCH, LATENT, dtype=torch.float64))
    fake_generator = generator(torch.randn(BATCH, LATENT, dtype=torch.float64))
    softplus = torch.nn.functional.softplus
    expected_critic = softplus(critic(fake_critic) - critic(real)).mean()
    expected_generator = softplus(critic(real) - critic(fake_generator)).mean()
    torch.testing.assert_close(critic_term, expected_critic, rtol=1e-12, atol=0)
    torch.testing.assert_close(generator_term, expected_generator, rtol=1e-12, atol=0)


# A GAN (its loss terms included) pickles, as ``ddp_spawn`` needs to start its processes.

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
