"""What the callback and dashboard tests share: plain user modules, a tiny data set, a trainer
that logs to TensorBoard every step, and readers of the event files it writes.

The plain modules are what a user writes (no gradreg LightningModule). With ``lr=0`` the
parameters never move, so every logged value is the same closed-form number at every step.
"""


from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator as ea
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradreg.penalties import as_points, double_backprop, interpolate, wgan_gp

FEATURES, CLASSES, BATCH = 4, 3, 8
WEIGHT = 0.5


def data() -> tuple[Tensor, Tensor]:
    inputs = torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(0))
    return inputs, torch.arange(BATCH) % CLASSES


def loader(batch_size: int = BATCH) -> DataLoader:
    return DataLoader(TensorDataset(*data()), batch_size=batch_size)


class PlainClassifier(pl.LightningModule):
    """A linear classifier with a double-backprop penalty, written as a user would."""

    def __init__(self, weight: float = WEIGHT, lr: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Linear(FEATURES, CLASSES)
        self.gp = double_backprop(weight=weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        x = as_points(x)
        per_sample = F.cross_entropy(self(x), y, reduction="none")
        return per_sample.mean() + self.gp(per_sample, x)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.log("train/loss", F.cross_entropy(self(x), y))
        return self.loss(x, y)

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: list[Tensor], stage: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{stage}/loss", F.cross_entropy(logits, y))
        self.log(f"{stage}/acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class ManualClassifier(PlainClassifier):
    """The same model trained in manual optimization, with the usual zero_grad/backward/step."""

    def __init__(self, **kwargs: float) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.loss(*batch))
        optimizer.step()


def trainer(tmp_path: Path, callbacks: list[pl.Callback], **kwargs: object) -> pl.Trainer:
    options = {
        "max_steps": 3,
        "log_every_n_steps": 1,
        "limit_val_batches": 0,
        "logger": TensorBoardLogger(tmp_path, default_hp_metric=False),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        **kwargs,
    }
    return pl.Trainer(callbacks=callbacks, **options)


def fit(tmp_path: Path, module: pl.LightningModule, callbacks: list[pl.Callback],
        **kwargs: object) -> pl.Trainer:
    run = trainer(tmp_path, callbacks, **kwargs)
    run.fit(module, loader(), loader())
    return run


def events(run: pl.Trainer) -> ea.EventAccumulator:
    """Everything TensorBoard would read from the run's directory (all files, nothing dropped)."""
    kinds = (ea.SCALARS, ea.HISTOGRAMS, ea.IMAGES, ea.TENSORS, ea.COMPRESSED_HISTOGRAMS, ea.AUDIO)
    accumulator = ea.EventAccumulator(run.logger.log_dir, size_guidance=dict.fromkeys(kinds, 0))
    accumulator.Reload()
    return accumulator


def scalars(run: pl.Trainer, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in events(run).Scalars(tag)}


def hand_input_gradients(weight: Tensor, bias: Tensor) -> Tensor:
    r"""Closed-form input gradients of the :func:`data` batch, one row per sample.

    :math:`\nabla_{x_i} \mathrm{CE}(W x_i + b, y_i) = W^\top(\mathrm{softmax}(W x_i + b) - e_{y_i})`
    """
    x, y = data()
    return (torch.softmax(x @ weight.T + bias, dim=1) - F.one_hot(y, CLASSES)) @ weight


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers, like a GAN's critic and generator."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.first = nn.Linear(FEATURES, 1)
        self.second = nn.Linear(FEATURES, 1)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        x, _ = batch
        for optimizer, layer in zip(self.optimizers(), (self.first, self.second), strict=True):
            optimizer.zero_grad()
            self.manual_backward(layer(x).sum())
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.first.parameters(), lr=0.0),
                torch.optim.SGD(self.second.parameters(), lr=0.0)]


class PlainGan(pl.LightningModule):
    """A 2D WGAN-GP written by a user; ``discriminator`` instead of the default ``critic``."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.latent_dim, self.lr = 3, lr
        self.generator = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 2))
        self.discriminator = nn.Linear(2, 1)  # linear: D(x) = a.x + c, ||grad D|| = ||a||
        self.gp = wgan_gp()

    def training_step(self, real: Tensor, batch_idx: int) -> None:
        critic_optimizer, generator_optimizer = self.optimizers()
        fake = self.generator(torch.randn(len(real), self.latent_dim))
        points = interpolate(real, fake)
        critic_loss = (self.discriminator(fake.detach()).mean() - self.discriminator(real).mean()
                       + self.gp(self.discriminator(points).squeeze(1), points))
        critic_optimizer.zero_grad()
        self.manual_backward(critic_loss)
        critic_optimizer.step()
        generator_optimizer.zero_grad()
        self.manual_backward(-self.discriminator(fake).mean())
        generator_optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.discriminator.parameters(), lr=self.lr),
                torch.optim.Adam(self.generator.parameters(), lr=self.lr)]


def real_points() -> DataLoader:
    return DataLoader(torch.randn(4 * BATCH, 2, generator=torch.Generator().manual_seed(1)),
                      batch_size=BATCH)
