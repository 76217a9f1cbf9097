"""The classifier-based quality of generated images: the class-histogram measure on hand-built
cases, and the scorer trained on the digits scoring a generator that only makes one class."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gradreg.evaluation.sample_quality import SampleScorer, class_histogram_metrics
from gradreg.lightning.data import DigitsDataModule


def test_one_class_covers_one_mode_and_its_kl_is_log_of_one_over_its_share() -> None:
    real = torch.arange(10).repeat(3)  # uniform over 10 classes
    assert class_histogram_metrics(torch.full((7,), 4), real, 10) == (1, pytest.approx(
        math.log(10)))
    assert class_histogram_metrics(real.flip(0), real, 10) == (10, pytest.approx(0.0))
    # q = (1/2, 1/2) on classes 0 and 1, p = (1/4, 3/4): 1/2 log 2 + 1/2 log(2/3)
    modes, kl = class_histogram_metrics(torch.tensor([0, 1]), torch.tensor([0, 1, 1, 1]), 2)
    assert modes == 2 and kl == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))
    # a class no real sample is predicted as: infinitely far
    assert class_histogram_metrics(torch.tensor([2]), torch.tensor([0, 1]), 3)[1] == math.inf


@pytest.fixture(scope="module")
def digits() -> DigitsDataModule:
    return DigitsDataModule(shape=(1, 16, 16), batch_size=64)


def test_scorer_on_a_one_class_generator(digits: DigitsDataModule, tmp_path: Path) -> None:
    cache = tmp_path / "scorer.pt"
    scorer = SampleScorer(10, (1, 16, 16), str(cache), epochs=5)
    scorer.prepare(digits.train_dataloader())
    assert cache.is_file() and bool(scorer.trained)
    real, labels = digits.splits["test"].tensors
    _, predicted = scorer.features_and_classes(real)
    assert float((predicted == labels).double().mean()) > 0.9  # a usable judge of the classes

    threes = real[(labels == 3) & (predicted == 3)]  # "a generator that only makes 3s"
    scores = scorer(real, threes)
    share_of_threes = float((predicted == 3).double().mean())
    assert float(scores["modes"]) == 1.0
    assert float(scores["kl"]) == pytest.approx(math.log(1 / share_of_threes), rel=1e-6)
    assert float(scorer(real, real)["kl"]) == 0.0 and float(scorer(real, real)["modes"]) == 10
    assert float(scorer(real, real)["feature_energy_distance"]) == pytest.approx(0.0, abs=1e-9)
    assert float(scores["feature_energy_distance"]) > 1.0

    cached = SampleScorer(10, (1, 16, 16), str(cache), epochs=5)
    cached.prepare([])  # no data: it loads the file
    assert torch.equal(cached(real, threes)["kl"], scores["kl"])


def test_scorer_does_not_touch_the_global_rng(digits: DigitsDataModule, tmp_path: Path) -> None:
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    SampleScorer(10, (1, 16, 16), str(tmp_path / "s.pt"), epochs=1).prepare(
        digits.train_dataloader())
    assert torch.equal(torch.rand(3), expected)


def test_an_untrained_scorer_says_what_to_call(tmp_path: Path) -> None:
    scorer = SampleScorer(10, (1, 16, 16), str(tmp_path / "s.pt"))
    with pytest.raises(RuntimeError, match=r"call prepare\(train batches\) first"):
        scorer(torch.zeros(2, 1, 16, 16), torch.zeros(2, 1, 16, 16))
