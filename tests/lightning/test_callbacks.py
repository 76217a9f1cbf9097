"""The callbacks on plain user modules, checked against hand-derived values in the event files.

The plain modules here are what a user writes (no gradreg LightningModule); the other callback
and dashboard tests import them. With ``lr=0`` the parameters never move, so every logged value
is the same closed-form number at every step.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator as ea
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradreg import autograd_graph
from gradreg.lightning.callbacks import (
    AutogradGraphLogger,
    GradientNormMonitor,
    PenaltyWeightSchedule,
    WeightSchedule,
)
from gradreg.penalties import as_points, double_backprop

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


# --- GradientNormMonitor -------------------------------------------------------------------------


def test_monitor_logs_hand_computed_gradient_norms_and_penalty(tmp_path: Path) -> None:
    module = PlainClassifier()
    run = fit(tmp_path, module, [GradientNormMonitor()])

    # The training loss by hand: mean CE + weight * mean_i ||W^T (softmax_i - e_i)||^2.
    weight = module.net.weight.detach().clone().requires_grad_()
    bias = module.net.bias.detach().clone().requires_grad_()
    x, y = data()
    input_grads = hand_input_gradients(weight, bias)
    loss = F.cross_entropy(x @ weight.T + bias, y) + WEIGHT * input_grads.square().sum(1).mean()
    grad_weight, grad_bias = torch.autograd.grad(loss, [weight, bias])
    norms = input_grads.detach().norm(dim=1)

    expected = {
        "grad_2.0_norm/net.weight": grad_weight.norm(),
        "grad_2.0_norm/net.bias": grad_bias.norm(),
        "grad_2.0_norm_total": torch.cat([grad_weight.flatten(), grad_bias]).norm(),
        "input_grad/norm_mean": norms.mean(),
        "input_grad/norm_max": norms.max(),
        "penalty/gp": norms.square().mean(),
    }
    for tag, value in expected.items():
        logged = scalars(run, tag)
        assert sorted(logged) == [0, 1, 2], tag
        assert all(v == pytest.approx(float(value), rel=1e-5) for v in logged.values()), tag

    histograms = events(run).Histograms("input_grad/norm")
    assert [h.step for h in histograms] == [0, 1, 2]
    histogram = histograms[0].histogram_value
    assert histogram.num == BATCH
    assert histogram.sum == pytest.approx(float(norms.sum()), rel=1e-5)
    assert histogram.max == pytest.approx(float(norms.max()), rel=1e-5)


def test_monitor_follows_every_n_steps(tmp_path: Path) -> None:
    run = fit(tmp_path, PlainClassifier(), [GradientNormMonitor(every_n_steps=2)], max_steps=5)
    assert sorted(scalars(run, "grad_2.0_norm_total")) == [1, 3]
    assert sorted(scalars(run, "penalty/gp")) == [1, 3]


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


def test_monitor_logs_each_optimizers_own_parameters(tmp_path: Path) -> None:
    run = fit(tmp_path, TwoOptimizers(), [GradientNormMonitor(loss_fn=None)], max_steps=2)
    # d(sum_i w.x_i + b)/dw = sum_i x_i and d/db = BATCH, for each layer.
    x, _ = data()
    expected = math.sqrt(float(x.sum(0).square().sum()) + BATCH**2)
    for owner in ("first", "second"):  # named after the submodule each optimizer updates
        logged = scalars(run, f"grad_2.0_norm_total/{owner}")
        assert list(logged.values()) == [pytest.approx(expected, rel=1e-5)]
    tags = events(run).Tags()["scalars"]
    assert {"grad_2.0_norm/first.weight", "grad_2.0_norm/second.weight"} <= set(tags)


@pytest.mark.parametrize("norm_type", [0, -1.0, "two", None])
def test_monitor_rejects_bad_norm_type(norm_type: object) -> None:
    with pytest.raises(ValueError, match="norm_type must be a number > 0 or 'inf'"):
        GradientNormMonitor(norm_type)


def test_monitor_rejects_bad_interval() -> None:
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
        GradientNormMonitor(every_n_steps=0)


def test_monitor_asks_for_loss_fn_none_on_unpaired_batches(tmp_path: Path) -> None:
    class Unpaired(PlainClassifier):
        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            return self(batch).sum()

    run = trainer(tmp_path, [GradientNormMonitor()])
    unpaired = DataLoader(data()[0], batch_size=BATCH)
    with pytest.raises(ValueError, match="Pass loss_fn=None"):
        run.fit(Unpaired(), unpaired)


# --- PenaltyWeightSchedule -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # start 4, end 0, begin 2, steps 4: s = clip((t - 2) / 4, 0, 1) at t = 0, 2, 3, 4, 6, 9
        ("constant", [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
        ("linear", [4.0, 4.0, 3.0, 2.0, 0.0, 0.0]),
        ("cosine", [4.0, 4.0, 2 + 2 * math.cos(math.pi / 4), 2.0, 0.0, 0.0]),
        ("step", [4.0, 4.0, 4.0, 4.0, 0.0, 0.0]),
    ],
)
def test_weight_schedule_formulas(kind: str, expected: list[float]) -> None:
    schedule = WeightSchedule(kind, start=4.0, end=0.0, steps=4, begin=2)
    assert [schedule(t) for t in (0, 2, 3, 4, 6, 9)] == pytest.approx(expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "exponential"}, r"unknown schedule kind 'exponential'; choose one of"),
        ({"start": -1.0}, r"start=-1.0: a penalty weight must be a finite number >= 0"),
        ({"end": math.inf}, r"end=inf: a penalty weight must be a finite number >= 0"),
        ({"steps": 0}, r"steps=0: the ramp needs an int number of optimizer steps >= 1"),
        ({"begin": -2}, r"begin=-2: the first step of the ramp must be an int >= 0"),
        ({"penalties": "gp"}, r"write penalties=\['gp'\]"),
    ],
)
def test_schedule_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PenaltyWeightSchedule(**kwargs)


def test_schedule_sets_and_logs_the_formula(tmp_path: Path) -> None:
    module = PlainClassifier()
    schedule = PenaltyWeightSchedule("linear", start=0.0, end=2.0, steps=4)
    run = fit(tmp_path, module, [schedule], max_steps=6)
    expected = {t: 2.0 * min(t / 4, 1.0) for t in range(6)}  # 0, .5, 1, 1.5, 2, 2
    assert scalars(run, "penalty_weight/gp") == pytest.approx(expected)
    assert module.gp.weight == schedule.weights["gp"] == 2.0
    assert schedule.optimizer_steps == {"gp": 5}


class TwoPenalties(PlainClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.other = double_backprop(weight=3.0)


def test_schedule_sets_only_the_named_penalties(tmp_path: Path) -> None:
    module = TwoPenalties()
    fit(tmp_path, module, [PenaltyWeightSchedule("constant", end=0.25, penalties=["gp"])])
    assert (module.gp.weight, module.other.weight) == (0.25, 3.0)


def test_schedule_names_unknown_and_missing_penalties(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no penalty at \['gq'\]; the module's penalties are "
                                         r"\['gp', 'other'\]"):
        fit(tmp_path, TwoPenalties(), [PenaltyWeightSchedule(penalties=["gq"])])
    with pytest.raises(ValueError, match="found no GradientPenalty in TwoOptimizers"):
        fit(tmp_path, TwoOptimizers(), [PenaltyWeightSchedule()])


def test_schedule_state_is_checkpointed_and_restored(tmp_path: Path) -> None:
    schedule = PenaltyWeightSchedule("cosine", start=1.0, end=0.0, steps=8)
    first = fit(tmp_path, PlainClassifier(), [schedule], max_steps=3)
    path = tmp_path / "schedule.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"][schedule.state_key]
    weight = (1 + math.cos(math.pi * 2 / 8)) / 2
    expected = {"kind": "cosine", "start": 1.0, "end": 0.0, "steps": 8, "begin": 0,
                "optimizer_steps": {"gp": 2}, "weights": {"gp": pytest.approx(weight)}}
    assert saved == expected

    restored = PenaltyWeightSchedule("cosine", start=1.0, end=0.0, steps=8)
    module = PlainClassifier()
    trainer(tmp_path, [restored], max_steps=3).fit(module, loader(), ckpt_path=path)
    assert restored.state_dict() == saved
    assert module.gp.weight == pytest.approx(weight)  # the penalty's own state


def test_schedule_warns_when_resumed_with_another_schedule(tmp_path: Path) -> None:
    schedule = PenaltyWeightSchedule("linear", steps=8)
    first = fit(tmp_path, PlainClassifier(), [schedule], max_steps=2)
    path = tmp_path / "schedule.ckpt"
    first.save_checkpoint(path)
    with pytest.warns(UserWarning, match="the checkpoint was trained with .*kind='linear'.*; "
                                         "resuming with .*kind='step'"):
        trainer(tmp_path, [PenaltyWeightSchedule("step", steps=8)], max_steps=2).fit(
            PlainClassifier(), loader(), ckpt_path=path)


# --- AutogradGraphLogger -------------------------------------------------------------------------


def logged_text(run: pl.Trainer, tag: str) -> str:
    """The text of a text summary, with the Markdown code-block indentation removed."""
    (event,) = events(run).Tensors(f"{tag}/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    return "\n".join(line.removeprefix("    ") for line in text.splitlines())


def test_graph_logger_logs_the_graph_of_the_penalized_loss_once(tmp_path: Path) -> None:
    module = ManualClassifier()
    run = fit(tmp_path, module, [AutogradGraphLogger()], max_steps=2)
    graph = autograd_graph(module.loss(*data()))  # lr=0: the same graph at every step
    assert logged_text(run, "autograd_graph/text") == graph.to_text()
    assert logged_text(run, "autograd_graph/dot") == graph.to_dot()
    # The graph of the gradient is in it: more nodes than the plain loss's backward graph.
    x, y = data()
    plain = autograd_graph(F.cross_entropy(module(x), y))
    assert len(graph.nodes) > len(plain.nodes) + 5


def test_graph_logger_sees_the_loss_of_automatic_optimization(tmp_path: Path) -> None:
    module = PlainClassifier()
    run = fit(tmp_path, module, [AutogradGraphLogger(at_step=1)], max_steps=3)
    (event,) = events(run).Tensors("autograd_graph/text/text_summary")
    assert event.step == 1
    # Lightning backpropagates training_step's loss divided by accumulate_grad_batches.
    assert logged_text(run, "autograd_graph/text") == autograd_graph(
        module.loss(*data()) / 1).to_text()


def test_graph_logger_warns_when_backward_bypasses_lightning(tmp_path: Path) -> None:
    class BareBackward(ManualClassifier):
        def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.loss(*batch).backward()
            optimizer.step()

    with pytest.warns(UserWarning, match=r"saw no backward .* self.manual_backward\(loss\)"):
        fit(tmp_path, BareBackward(), [AutogradGraphLogger()], max_steps=1)


def test_graph_logger_rejects_bad_step() -> None:
    with pytest.raises(ValueError, match="at_step must be an int >= 0"):
        AutogradGraphLogger(at_step=-1)
