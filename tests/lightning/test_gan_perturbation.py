"""approx_r1 and approx_r2 in the GAN: the scores of the adversarial forward are shared, only the
perturbed samples take a forward of their own; the terms against the formulas written out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradreg.lightning.gan_loss import GANLoss
from gradreg.models import MLP
from gradreg.penalties import make_penalty

BATCH, LATENT = 8, 2


def test_approx_r1_and_r2_share_the_adversarial_scores() -> None:
    torch.manual_seed(0)
    generator = MLP(LATENT, 2, hidden=(16,), activation="tanh").double()
    critic = MLP(2, 1, hidden=(16,), activation="tanh").double()
    penalties = {"r1": make_penalty("approx_r1", weight=3.0, step=0.05),
                 "r2": make_penalty("approx_r2", weight=5.0, step=0.05)}
    gan_loss = GANLoss(generator, critic, penalties, adversarial="nonsaturating",
                       latent_dim=LATENT)
    real = torch.randn(BATCH, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    calls = []
    hook = critic.register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(7)
    terms = gan_loss.critic_terms(real)
    hook.remove()
    assert len(calls) == 4  # reals and fakes for the loss, one perturbed forward each

    torch.manual_seed(7)
    fake = generator(torch.randn(BATCH, LATENT, dtype=torch.float64)).detach()
    eps_real, eps_fake = torch.randn(BATCH, 2).double(), torch.randn(BATCH, 2).double()
    d_real, d_fake = critic(real), critic(fake)
    adversarial = (F.softplus(d_fake) + F.softplus(-d_real)).mean()
    r1 = 3.0 / 2 * ((critic(real + 0.05 * eps_real) - d_real) / 0.05).square().mean()
    r2 = 5.0 / 2 * ((critic(fake + 0.05 * eps_fake) - d_fake) / 0.05).square().mean()
    for mine, theirs in [(terms["adversarial"], adversarial), (terms["r1"], r1),
                         (terms["r2"], r2)]:
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-12, atol=0)
    params = list(critic.parameters())
    mine = torch.autograd.grad(sum(terms.values()), params)
    theirs = torch.autograd.grad(adversarial + r1 + r2, params)
    for m, t in zip(mine, theirs, strict=True):
        torch.testing.assert_close(m, t, rtol=1e-10, atol=1e-12)


def test_a_dropout_critic_is_perturbed_at_the_adversarial_forwards_mask() -> None:
    """With dropout in the critic, each perturbed forward replays the random state of the
    adversarial forward of the same samples: the terms equal the formulas evaluated with the
    forwards run from those states (without the replay: another mask, and R1 ~1e3 too large)."""
    torch.manual_seed(0)
    generator = MLP(LATENT, 2, hidden=(16,), activation="tanh").double()
    critic = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Dropout(0.3),
                           nn.Linear(16, 1)).double()
    penalties = {"r1": make_penalty("approx_r1", weight=3.0, step=0.05),
                 "r2": make_penalty("approx_r2", weight=5.0, step=0.05)}
    gan_loss = GANLoss(generator, critic, penalties, adversarial="nonsaturating",
                       latent_dim=LATENT)
    real = torch.randn(BATCH, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.manual_seed(7)
    terms = gan_loss.critic_terms(real)

    torch.manual_seed(7)
    fake = generator(torch.randn(BATCH, LATENT, dtype=torch.float64)).detach()
    real_state = torch.get_rng_state()
    d_real = critic(real)
    fake_state = torch.get_rng_state()
    d_fake = critic(fake)
    eps_real, eps_fake = torch.randn(BATCH, 2).double(), torch.randn(BATCH, 2).double()
    torch.set_rng_state(real_state)
    r1 = 3.0 / 2 * ((critic(real + 0.05 * eps_real) - d_real) / 0.05).square().mean()
    torch.set_rng_state(fake_state)
    r2 = 5.0 / 2 * ((critic(fake + 0.05 * eps_fake) - d_fake) / 0.05).square().mean()
    for mine, theirs in [(terms["r1"], r1), (terms["r2"], r2)]:
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-12, atol=0)
    params = list(critic.parameters())
    mine = torch.autograd.grad(terms["r1"] + terms["r2"], params)
    theirs = torch.autograd.grad(r1 + r2, params)
    for m, t in zip(mine, theirs, strict=True):
        torch.testing.assert_close(m, t, rtol=1e-10, atol=1e-12)


def test_every_method_at_the_reals_takes_what_it_can_of_the_adversarial_forward() -> None:
    """R1 at the reals through the GAN loss, by each method, against R1 written out: the critic
    runs on the reals and fakes for the adversarial term, and once more only where the method
    needs another forward (the shifted points of the finite difference, the perturbed ones of
    the estimate); the value of the exact-valued methods is R1's, and the parameter gradient
    exact (double backward) or within the method's error (the finite difference, in
    float64)."""
    torch.manual_seed(0)
    generator = MLP(LATENT, 2, hidden=(16,), activation="tanh").double()
    critic = MLP(2, 1, hidden=(16,), activation="tanh").double()
    real = torch.randn(BATCH, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = real.clone().requires_grad_()
    (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
    r1 = 5.0 * g.square().sum(1).mean()
    params = list(critic.parameters())
    exact = torch.cat([t.flatten() for t in torch.autograd.grad(
        r1, params, allow_unused=True, materialize_grads=True)])
    forwards = {"double_backward": 2, "finite_difference": 3, "perturbation": 3}
    calls: list[int] = []
    hook = critic.register_forward_hook(lambda *_: calls.append(1))
    for method, expected in forwards.items():
        gan_loss = GANLoss(generator, critic, {"r1": make_penalty("r1", method=method)},
                           adversarial="nonsaturating", latent_dim=LATENT)
        calls.clear()
        term = gan_loss.critic_terms(real)["r1"]
        assert len(calls) == expected, method
        if method == "perturbation":
            continue  # an estimate of R1: held by the test above against its own formula
        torch.testing.assert_close(term.detach(), r1.detach(), rtol=1e-12, atol=0)
        got = torch.cat([t.flatten() for t in torch.autograd.grad(
            term, params, allow_unused=True, materialize_grads=True)])
        error = (got - exact).norm() / exact.norm()
        assert error < (1e-12 if method == "double_backward" else 1e-6), (method, error)
    hook.remove()
