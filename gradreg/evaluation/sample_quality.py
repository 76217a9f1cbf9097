r"""Quality of generated images, offline: a classifier of the real data scores the samples.

Stacked MNIST's measure (Metz et al. 2017; VEEGAN, Srivastava et al. 2017; PacGAN, Lin et al.
2018) with a classifier trained here on the run's own real data instead of a pretrained one. With
:math:`c(x)` the classifier's predicted class, :math:`q` the class histogram of the generated
samples and :math:`p` that of held-out real samples (both normalized):

* ``modes``: the number of classes predicted for at least one generated sample;
* ``kl``: :math:`\mathrm{KL}(q \,\|\, p) = \sum_{k: q_k > 0} q_k \log(q_k / p_k)` (0 when the
  generator hits the classes as often as the data; :math:`\log(1/p_k)` when it only makes class
  :math:`k`; infinite if it makes a class that no real sample is predicted as);
* ``feature_energy_distance``: the energy distance between generated and real samples in the
  classifier's feature space (its flattened last hidden layer).

The classifier (:class:`~gradreg.models.CNN`, average-pooled) is trained once, on the training
split, with its own seeded random stream (the run's RNG is untouched), then frozen and saved to
``cache``; a run that finds the file loads it instead of training.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradreg.evaluation.metrics import energy_distance
from gradreg.models import CNN


def class_histogram_metrics(fake_classes: Tensor, real_classes: Tensor, num_classes: int
                            ) -> tuple[int, float]:
    """``(modes, KL(q || p))`` from the predicted classes of generated and real samples."""
    q = torch.bincount(fake_classes, minlength=num_classes).double() / len(fake_classes)
    p = torch.bincount(real_classes, minlength=num_classes).double() / len(real_classes)
    hit = q > 0
    kl = float((q[hit] * (q[hit] / p[hit]).log()).sum()) if bool((p[hit] > 0).all()) else math.inf
    return int(hit.sum()), kl


class SampleScorer(nn.Module):
    """The classifier-based scores of the module docstring, as ``scorer(real, fake) -> dict``.

    Args:
        num_classes: classes of the real data.
        shape: ``[C, S, S]`` of one image.
        cache: where the trained classifier is saved (and loaded from, when it exists); None:
            trained in every run, nothing written.
        epochs, lr, channels: its training (Adam) and its two convolution widths.
        seed: seed of its initialization and shuffling.
    """

    def __init__(
        self,
        num_classes: int,
        shape: Sequence[int],
        cache: str | None,
        *,
        epochs: int = 10,
        lr: float = 1e-3,
        channels: Sequence[int] = (16, 32),
        seed: int = 0,
    ) -> None:
        super().__init__()
        in_channels, size, _ = (int(s) for s in shape)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.classifier = CNN(num_classes, in_channels=in_channels, image_size=size,
                                  channels=channels)
        self.num_classes = num_classes
        self.cache = None if cache is None else Path(cache)
        self.epochs, self.lr, self.seed = epochs, lr, seed
        self.register_buffer("trained", torch.zeros((), dtype=torch.bool))

    def prepare(self, batches: Iterable[Sequence[Tensor]]) -> None:
        """Train on ``(x, y)`` batches, or load the cached classifier; then freeze it."""
        if not bool(self.trained):
            if self.cache is not None and self.cache.is_file():
                self.classifier.load_state_dict(torch.load(self.cache, map_location="cpu"))
            else:
                self._train(batches)
            if self.cache is not None and not self.cache.is_file():
                tmp = self.cache.with_suffix(f".tmp{os.getpid()}")
                self.cache.parent.mkdir(parents=True, exist_ok=True)
                torch.save(self.classifier.state_dict(), tmp)
                tmp.replace(self.cache)  # never a half-written cache
            self.trained.fill_(True)
        self.classifier.requires_grad_(False)  # no dropout or BatchNorm: any mode scores alike

    def _train(self, batches: Iterable[Sequence[Tensor]]) -> None:
        device = self.trained.device
        with torch.random.fork_rng(devices=[]):  # the loader's shuffling: off the run's RNG
            torch.manual_seed(self.seed)
            self.classifier.train().requires_grad_(True)
            optimizer = torch.optim.Adam(self.classifier.parameters(), lr=self.lr)
            with torch.enable_grad():
                for _ in range(self.epochs):
                    for x, y, *_ in batches:
                        loss = F.cross_entropy(self.classifier(x.to(device)), y.to(device))
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        optimizer.step()

    @torch.no_grad()
    def features_and_classes(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The flattened last hidden layer and the predicted class of each image."""
        *hidden, out = self.classifier
        for layer in hidden:
            x = layer(x)
        return x, out(x).argmax(1)

    def forward(self, real: Tensor, fake: Tensor) -> dict[str, Tensor]:
        if not bool(self.trained):
            raise RuntimeError("SampleScorer is not trained: call prepare(train batches) first")
        real_features, real_classes = self.features_and_classes(real)
        fake_features, fake_classes = self.features_and_classes(fake)
        modes, kl = class_histogram_metrics(fake_classes, real_classes, self.num_classes)
        return {
            "modes": torch.tensor(float(modes)),
            "kl": torch.tensor(kl),
            "feature_energy_distance": energy_distance(real_features, fake_features).float(),
        }
