r"""A GAN on 2D data or images trained with critic penalties (manual optimization).

Schedule: every training batch is one critic step; after every ``n_critic``-th critic step
(counted on critic steps over the whole run, so epochs of any length and resumed runs keep the
rhythm) comes one generator step, i.e. ``n_critic`` critic updates per generator update as in
WGAN-GP's Algorithm 1. Each step: toggle the phase's optimizer (the other network's parameters stop
requiring grad), zero its gradients, one backward of the phase's total
(:mod:`gradreg.lightning.gan_loss`), one optimizer step. The critic-step counter is a buffer, so
it is checkpointed.

Validation draws a fixed set of latents (its own seeded generator: it never touches the training
RNG) and reports the energy distance between fakes and held-out reals, the critic's Wasserstein
estimate :math:`E[D(x)] - E[D(G(z))]` and, on the Gaussian mixtures, modes covered and the share
of high-quality samples (:mod:`gradreg.evaluation.metrics`). For images the energy distance is over
flattened pixels, and a :class:`~gradreg.evaluation.sample_quality.SampleScorer` (trained on the
training split at the start of fit or test) adds classes covered (``modes``), the KL between the
generated and real class histograms (``kl``) and the energy distance in its feature space.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
from torch import Tensor, nn

from gradreg.evaluation.metrics import energy_distance, mode_metrics
from gradreg.evaluation.sample_quality import SampleScorer
from gradreg.lightning.compat import attached_trainer
from gradreg.lightning.data.toy import MIXTURES, TOY_SETS
from gradreg.lightning.gan_loss import CRITIC_POINTS, GENERATOR_POINTS, GANLoss
from gradreg.lightning.loss_terms import TASK, record_terms
from gradreg.lightning.penalized import (
    OptimizerFactory,
    PenalizedModule,
    check_penalties,
    settle_finite_checks,
)
from gradreg.lightning.precision import loss_scale
from gradreg.penalties import GradientPenalty

# WGAN-GP's toy experiments: Adam, lr 1e-4, betas (0.5, 0.9)
DEFAULT_OPTIMIZER = partial(torch.optim.Adam, lr=1e-4, betas=(0.5, 0.9))


class GAN(PenalizedModule):
    """Generator ``G: latent -> data`` and critic ``D: data -> [B, 1]`` with penalties.

    The data are 2D points or images (``[B, C, S, S]``, e.g. :class:`~gradreg.models.DCGANGenerator`
    and :class:`~gradreg.models.DCGANCritic`).

    Args:
        generator, critic: the two networks (the critic without BatchNorm: per-sample critic
            gradients need samples that do not interact).
        penalties: name -> penalty on points real, fake, interpolates, perturbed (critic) or
            latents (generator); others raise ``ValueError``.
        n_critic: critic steps per generator step, >= 1.
        loss: the adversarial term, ``"wgan"``, ``"nonsaturating"`` or ``"relativistic"``
            (:mod:`gradreg.lightning.gan_loss`).
        latent_dim: the generator's input size.
        generator_optimizer, critic_optimizer: build the optimizers from the parameters.
        dataset: the toy set's name; on ``8gaussians``/``25gaussians`` validation reports modes.
        eval_seed: seed of the validation latents.
        scorer: classifier-based scores of generated images (module docstring), or ``None``.
    """

    def __init__(
        self,
        generator: nn.Module,
        critic: nn.Module,
        penalties: Mapping[str, GradientPenalty] | None = None,
        *,
        n_critic: int = 5,
        loss: str = "wgan",
        latent_dim: int = 2,
        generator_optimizer: OptimizerFactory = DEFAULT_OPTIMIZER,
        critic_optimizer: OptimizerFactory = DEFAULT_OPTIMIZER,
        dataset: str | None = None,
        eval_seed: int = 1234,
        scorer: SampleScorer | None = None,
    ) -> None:
        super().__init__()
        if not (isinstance(n_critic, int) and n_critic >= 1):
            raise ValueError(f"n_critic must be an integer >= 1, got {n_critic!r}")
        if dataset is not None and dataset not in TOY_SETS:
            raise ValueError(f"dataset={dataset!r} is unknown; valid values: {sorted(TOY_SETS)}")
        penalties = dict(penalties or {})
        check_penalties(penalties, critic, (*CRITIC_POINTS, *GENERATOR_POINTS), "GAN")
        self.save_hyperparameters(
            ignore=["generator", "critic", "penalties", "generator_optimizer", "critic_optimizer",
                    "scorer"]
        )
        self.automatic_optimization = False
        self.generator, self.critic = generator, critic
        self.penalties = nn.ModuleDict(penalties)
        self.gan_loss = GANLoss(generator, critic, self.penalties, adversarial=loss,
                                latent_dim=latent_dim)
        self.n_critic = n_critic
        self.latent_dim = latent_dim
        self.optimizer_factories = (generator_optimizer, critic_optimizer)
        self.mixture = MIXTURES.get(dataset) if dataset else None
        self.eval_seed = eval_seed
        self.scorer = scorer
        self.register_buffer("critic_steps", torch.zeros((), dtype=torch.long))
        self._eval: dict[str, list[Tensor]] = {"real": [], "fake": []}

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z)

    def on_fit_start(self) -> None:
        self._prepare_scorer()

    def on_test_start(self) -> None:
        self._prepare_scorer()

    def _prepare_scorer(self) -> None:
        """Train the scorer on the training split (or load its cache) before any evaluation."""
        if self.scorer is None:
            return
        datamodule = self.trainer.datamodule
        if datamodule is None:
            raise ValueError("the GAN's scorer trains on the training split: pass the data as a "
                             "datamodule (trainer.fit(model, datamodule=...))")
        self.scorer.prepare(datamodule.train_dataloader())

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        real = batch[0]
        opt_generator, opt_critic = self.optimizers()
        self._step("critic", opt_critic, self.gan_loss.critic_terms, real)
        self.critic_steps += 1
        if self.critic_steps % self.n_critic == 0:
            self._step("generator", opt_generator, self.gan_loss.generator_terms, real)

    def _step(
        self,
        phase: str,
        optimizer: torch.optim.Optimizer,
        terms_of: Callable[[Tensor, float | None], dict[str, Tensor]],
        real: Tensor,
    ) -> None:
        with self.toggled_optimizer(optimizer):
            terms = terms_of(real, loss_scale(attached_trainer(self)))  # None unless fp16
            optimizer.zero_grad(set_to_none=True)
            record_terms(self, {TASK: terms["adversarial"],  # for GradientSplit, on its steps
                                **{name: term for name, term in terms.items()
                                   if name != "adversarial"}})
            self.manual_backward(sum(terms.values()))
            optimizer.step()
        # the penalties in the logger as penalty/weighted/penalties.<name> (the monitor's)
        self.log(f"train/{phase}/adversarial", terms["adversarial"].detach())
        self.log_dict({f"train/{phase}/{name}": value.detach() for name, value in terms.items()
                       if name != "adversarial"}, logger=False)

    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        real = batch[0]
        rng = torch.Generator().manual_seed(self.eval_seed + batch_idx)
        z = torch.randn(real.shape[0], self.latent_dim, generator=rng).to(real)
        self._eval["real"].append(real)
        self._eval["fake"].append(self.generator(z))

    def test_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        settle_finite_checks(self.penalties)

    def on_validation_epoch_end(self) -> None:
        self._report("val")

    def on_test_epoch_end(self) -> None:
        self._report("test")

    def _report(self, stage: str) -> None:
        real, fake = (torch.cat(self._eval[key]) for key in ("real", "fake"))
        self._eval = {"real": [], "fake": []}
        metrics = {
            f"{stage}/energy_distance": energy_distance(real.flatten(1), fake.flatten(1)).float(),
            f"{stage}/wasserstein": (self.critic(real).mean() - self.critic(fake).mean()),
        }
        if self.mixture is not None:
            modes, high_quality = mode_metrics(fake, *self.mixture)
            metrics[f"{stage}/modes"] = float(modes)
            metrics[f"{stage}/high_quality"] = high_quality
        if self.scorer is not None:
            metrics |= {f"{stage}/{name}": value for name, value in self.scorer(real, fake).items()}
        self.log_dict(metrics, prog_bar=stage == "val", sync_dist=True)  # mean over DDP ranks

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        make_generator_opt, make_critic_opt = self.optimizer_factories
        return [make_generator_opt(self.generator.parameters()),
                make_critic_opt(self.critic.parameters())]
