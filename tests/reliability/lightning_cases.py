"""Small Lightning setups shared by the resume and DDP tests: a GAN and a classifier on 2D data.

Everything is seeded; a fit of a few epochs takes about a second on one CPU thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from gradreg.lightning import gan_loss
from gradreg.lightning.classifier import Classifier
from gradreg.lightning.data import sample_toy
from gradreg.lightning.gan import GAN
from gradreg.models import MLP
from gradreg.penalties import as_points, make_penalty

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False,
         "num_sanity_val_steps": 0, "inference_mode": False, "accelerator": "cpu"}


def gan(**penalties: dict[str, Any]) -> GAN:
    """A 2D GAN (MLPs with one hidden layer of 16), n_critic 2, with the named preset penalties
    (``name=dict(preset=..., **overrides)``)."""
    torch.manual_seed(0)
    made = {key: make_penalty(**spec) for key, spec in penalties.items()}
    return GAN(MLP(2, 2, (16,), "tanh"), MLP(2, 1, (16,), "tanh"), made, n_critic=2,
               latent_dim=2, dataset="8gaussians",
               generator_optimizer=partial(torch.optim.SGD, lr=1e-2),
               critic_optimizer=partial(torch.optim.SGD, lr=1e-2))


def classifier(**penalties: dict[str, Any]) -> Classifier:
    """A 2-class MLP classifier on moons (hidden 16, tanh, SGD lr 0.1) with the given penalties."""
    torch.manual_seed(0)
    made = {key: make_penalty(**spec) for key, spec in penalties.items()}
    return Classifier(MLP(2, 2, (16,), "tanh"), made, input_range=None,
                      optimizer=partial(torch.optim.SGD, lr=0.1))


@contextmanager
def _interpolation_coefficients(u: Tensor) -> Iterator[None]:
    """WGAN-GP's interpolates with the given per-sample coefficients, for the block."""
    draw = gan_loss.CRITIC_POINTS["interpolates"]
    gan_loss.CRITIC_POINTS["interpolates"] = lambda real, fake: as_points(torch.lerp(real, fake, u))
    try:
        yield
    finally:
        gan_loss.CRITIC_POINTS["interpolates"] = draw


class BatchNoiseGAN(GAN):
    """The GAN with its per-sample noise in the batch ``(real, z_critic, z_generator, u)``.

    The critic's and generator's latents and WGAN-GP's interpolation coefficients are read from
    the batch instead of drawn, so a sample gets the same noise however a batch is split over
    ranks, and the 1-process and 2-rank runs can be compared to the last bit of the data.
    """

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        real, z_critic, z_generator, u = batch
        latents = iter((z_critic, z_generator))
        self.gan_loss.latents = lambda like: next(latents)
        with _interpolation_coefficients(u):
            super().training_step((real,), batch_idx)


def batch_noise_gan(**penalties: dict[str, Any]) -> BatchNoiseGAN:
    torch.manual_seed(0)
    made = {key: make_penalty(**spec) for key, spec in penalties.items()}
    return BatchNoiseGAN(MLP(2, 2, (16,), "tanh"), MLP(2, 1, (16,), "tanh"), made, n_critic=2,
                         latent_dim=2, generator_optimizer=partial(torch.optim.SGD, lr=1e-2),
                         critic_optimizer=partial(torch.optim.SGD, lr=1e-2))


def noisy_toy(name: str, n: int, seed: int = 0) -> TensorDataset:
    """``(real, z_critic, z_generator, u)`` per sample for :class:`BatchNoiseGAN`."""
    rng = torch.Generator().manual_seed(seed + 100)
    real, _ = sample_toy(name, n, seed=seed)
    return TensorDataset(real, torch.randn(n, 2, generator=rng), torch.randn(n, 2, generator=rng),
                         torch.rand(n, 1, generator=rng))


class PenaltyOnly(L.LightningModule):
    """A critic trained on its R1 penalty alone, as in StyleGAN2's separate lazy-regularization
    pass. The output layer's bias does not change input gradients: it gets no gradient, which
    plain DDP refuses ("parameters that were not used in producing loss")."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.critic = MLP(2, 1, (16,), "tanh")
        self.r1 = make_penalty("r1", weight=1.0)

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        points = as_points(batch[0])
        return self.r1(self.critic(points), points)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def toy(name: str, n: int, seed: int = 0) -> TensorDataset:
    x, y = sample_toy(name, n, seed=seed)
    return TensorDataset(x, y)


class BatchSlice(Sampler[int]):
    """Indices of the ``part``-th of ``parts`` equal slices of each batch of ``batch_size``, in
    order: with a loader of batch size ``batch_size // parts``, rank ``part`` sees exactly its
    slice of the batch that one process sees (Lightning's DistributedSampler would shuffle)."""

    def __init__(self, length: int, batch_size: int, part: int, parts: int) -> None:
        self.length, self.batch_size, self.part, self.parts = length, batch_size, part, parts
        self.slice = batch_size // parts

    def __iter__(self):
        for start in range(0, self.length - self.batch_size + 1, self.batch_size):
            first = start + self.part * self.slice
            yield from range(first, first + self.slice)

    def __len__(self) -> int:
        return self.length // self.batch_size * self.slice


def sliced_loader(data: TensorDataset, batch_size: int, part: int = 0,
                  parts: int = 1) -> DataLoader:
    """Rank ``part``'s share of every batch of ``batch_size``, no shuffling."""
    return DataLoader(data, batch_size=batch_size // parts,
                      sampler=BatchSlice(len(data), batch_size, part, parts))


def parameters(module: nn.Module) -> dict[str, Tensor]:
    """Parameters and buffers (penalty counters, path-length mean) by name, detached copies."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()
            if isinstance(v, Tensor)}


def max_difference(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


__all__: Sequence[str] = ["QUIET", "L", "classifier", "gan", "max_difference", "parameters",
                          "sliced_loader", "toy"]
