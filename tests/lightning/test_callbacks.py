"""The callbacks on plain user modules, checked against hand-derived values in the event files."""

from __future__ import annotations

import logging
import math
from functools import partial
from pathlib import Path

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from gradreg import autograd_graph
from gradreg.lightning.callbacks import (
    AutogradGraphLogger,
    GradientNormMonitor,
    PenaltyWeightSchedule,
    WeightSchedule,
)
from gradreg.lightning.callbacks.graph import node_kinds
from gradreg.lightning.classifier import Classifier
from gradreg.lightning.gan import GAN
from gradreg.models import MLP
from gradreg.penalties import GradientPenalty, as_points, double_backprop, make_penalty, sam
from tests.lightning.helpers import (
    BATCH,
    WEIGHT,
    ManualClassifier,
    PlainClassifier,
    TwoOptimizers,
    data,
    events,
    fit,
    hand_input_gradients,
    loader,
    scalars,
    trainer,
)
from tests.lightning.test_split import Recorder, digits_like, sam_gradients_by_hand

# --- GradientNormMonitor -------------------------------------------------------------------------


def test_monitor_logs_hand_computed_losses_norms_histograms_and_penalty(tmp_path: Path) -> None:
    module = PlainClassifier()
    run = fit(tmp_path, module, [GradientNormMonitor()])

    # The training loss by hand: mean CE + weight * mean_i ||W^T (softmax_i - e_i)||^2.
    weight = module.net.weight.detach().clone().requires_grad_()
    bias = module.net.bias.detach().clone().requires_grad_()
    x, y = data()
    input_grads = hand_input_gradients(weight, bias)
    penalty = input_grads.square().sum(1).mean()
    loss = F.cross_entropy(x @ weight.T + bias, y) + WEIGHT * penalty
    grad_weight, grad_bias = torch.autograd.grad(loss, [weight, bias])
    norms = input_grads.detach().norm(dim=1)

    expected = {
        "loss/total": loss.detach(),
        "grad_norm/total": torch.cat([grad_weight.flatten(), grad_bias]).norm(),
        "input_grad/norm_mean": norms.mean(),
        "input_grad/norm_max": norms.max(),
        "penalty/unweighted/gp": penalty,
        "penalty/weighted/gp": WEIGHT * penalty,
        "penalty/weight/gp": WEIGHT,  # logged although no schedule runs
    }
    for tag, value in expected.items():
        logged = scalars(run, tag)
        assert sorted(logged) == [0, 1, 2], tag
        assert all(v == pytest.approx(float(value), rel=1e-5) for v in logged.values()), tag
    accumulator = events(run)
    assert not [tag for tag in accumulator.Tags()["scalars"] if tag.startswith("grad_2")]

    histograms = accumulator.Histograms("input_grad/norm")
    assert [h.step for h in histograms] == [0, 1, 2]
    histogram = histograms[0].histogram_value
    assert histogram.num == BATCH
    assert histogram.sum == pytest.approx(float(norms.sum()), rel=1e-5)
    assert histogram.max == pytest.approx(float(norms.max()), rel=1e-5)
    # Per layer, the weights' histogram (net.weight's 12 gradient entries) and the biases' in a
    # group of their own (net.bias's 3): their scales differ.
    assert set(accumulator.Tags()["histograms"]) == {"input_grad/norm", "param_grad/net",
                                                     "param_grad_bias/net"}
    for tag, entries in (("param_grad/net", grad_weight.flatten()),
                         ("param_grad_bias/net", grad_bias)):
        (first, *_) = accumulator.Histograms(tag)
        assert (first.step, first.histogram_value.num) == (0, entries.numel())
        assert first.histogram_value.sum == pytest.approx(float(entries.sum()), rel=1e-4,
                                                          abs=1e-6)
        assert first.histogram_value.min == pytest.approx(float(entries.min()), rel=1e-5)
        assert first.histogram_value.max == pytest.approx(float(entries.max()), rel=1e-5)


def test_monitor_follows_every_n_steps(tmp_path: Path) -> None:
    run = fit(tmp_path, PlainClassifier(), [GradientNormMonitor(every_n_steps=2)], max_steps=5)
    assert sorted(scalars(run, "grad_norm/total")) == [1, 3]
    assert sorted(scalars(run, "penalty/unweighted/gp")) == [1, 3]
    assert [h.step for h in events(run).Histograms("param_grad/net")] == [1, 3]


def test_monitor_logs_each_optimizers_own_parameters(tmp_path: Path) -> None:
    run = fit(tmp_path, TwoOptimizers(), [GradientNormMonitor(loss_fn=None)], max_steps=2)
    # d(sum_i w.x_i + b)/dw = sum_i x_i and d/db = BATCH, for each layer.
    x, _ = data()
    expected = math.sqrt(float(x.sum(0).square().sum()) + BATCH**2)
    module = TwoOptimizers()  # the same seeded initial weights; lr = 0
    for owner in ("first", "second"):  # named after the submodule each optimizer updates
        assert scalars(run, f"grad_norm/total/{owner}") == {0: pytest.approx(expected, rel=1e-5)}
        # the loss each optimizer's backward got: sum_i (w.x_i + b)
        value = float(getattr(module, owner)(x).sum())
        assert scalars(run, f"loss/total/{owner}") == {0: pytest.approx(value, rel=1e-5)}
    assert set(events(run).Tags()["histograms"]) == {
        f"{group}/{owner}" for group in ("param_grad", "param_grad_bias")
        for owner in ("first", "second")}


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


def test_schedule_sets_the_formula_and_the_monitor_logs_it(tmp_path: Path) -> None:
    module = PlainClassifier()
    schedule = PenaltyWeightSchedule("linear", start=0.0, end=2.0, steps=4)
    run = fit(tmp_path, module, [schedule, GradientNormMonitor()], max_steps=6)
    expected = {t: 2.0 * min(t / 4, 1.0) for t in range(6)}  # 0, .5, 1, 1.5, 2, 2
    assert scalars(run, "penalty/weight/gp") == pytest.approx(expected)
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


def test_a_schedule_scales_sams_correction_and_keeps_its_radius(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sam(0.05) under a constant schedule of weight 0.1 (float64 Classifier, SGD, 2 steps): the
    applied gradient is grad L + (0.1/0.05)(grad L(theta + 0.05 g_hat) - grad L), by hand at
    each step's parameters: the radius stays 0.05 (the schedule sets the weight only), and the
    fit's start names the penalty's shift in one info line (Lightning's records reach caplog's
    root handler even after an in-process app run's logging configuration disabled the loggers
    that existed then or stopped their propagation)."""
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities",
                 "lightning.pytorch.utilities.rank_zero"):
        monkeypatch.setattr(logging.getLogger(name), "propagate", True)
        monkeypatch.setattr(logging.getLogger(name), "disabled", False)
    torch.manual_seed(0)
    module = Classifier(MLP(6, 3, hidden=[5]).double(), {"sam": sam(0.05)}, pgd_steps=0,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    recorder = Recorder()
    schedule = PenaltyWeightSchedule("constant", end=0.1)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer(tmp_path, [schedule, recorder], max_steps=2).fit(module, digits_like())
    assert "'penalties.sam' shifts the parameters by radius=0.05" in caplog.text
    assert module.penalties["sam"].config.method.radius == 0.05
    for (before, (x, y)), applied in zip(recorder.before, recorder.grads, strict=True):
        g, shifted = sam_gradients_by_hand(before, x, y, 0.05)
        for (name, _), at, there in zip(before.named_parameters(), g, shifted, strict=True):
            torch.testing.assert_close(applied[f"backbone.{name}"], at + 2.0 * (there - at),
                                       rtol=1e-9, atol=1e-12)


# --- AutogradGraphLogger -------------------------------------------------------------------------


def logged_text(run: pl.Trainer, tag: str) -> str:
    """The text of a text summary, with the Markdown code-block indentation removed."""
    (event,) = events(run).Tensors(f"{tag}/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    return "\n".join(line.removeprefix("    ") for line in text.splitlines())


def test_graph_logger_logs_the_graph_of_the_penalized_loss_once(tmp_path: Path) -> None:
    module = ManualClassifier()
    run = fit(tmp_path, module, [AutogradGraphLogger()], max_steps=2)
    (image,) = events(run).Images("graph/autograd")  # the picture, once
    assert image.step == 0 and image.width >= 400
    assert not torch.is_anomaly_enabled()  # the mode is restored after the logged batch
    with torch.autograd.set_detect_anomaly(True, check_nan=False):  # marks the gradient's nodes
        loss = module.loss(*data())  # lr=0: the same graph at every step
    graph = autograd_graph(loss, dict(module.named_parameters()))
    assert logged_text(run, "autograd_graph/text") == graph.to_text()
    assert logged_text(run, "autograd_graph/dot") == graph.to_dot()
    # the text names the parameters and marks the double-backward nodes, as the picture does
    text = logged_text(run, "autograd_graph/text")
    assert "AccumulateGrad (net.weight [3, 4])" in text and "[double backward]" in text
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
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        loss = module.loss(*data()) / 1
    assert logged_text(run, "autograd_graph/text") == autograd_graph(
        loss, dict(module.named_parameters())).to_text()


class Alternating(PlainClassifier):
    """The penalty on even steps only: two graphs, alternating."""

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.loss(x, y) if self.global_step % 2 == 0 else F.cross_entropy(self(x), y)


def test_graph_logger_logs_each_distinct_graph_of_its_batches_once(tmp_path: Path) -> None:
    """Three watched batches, graphs A, B, A: A at step 0, B at step 1, the second A not again."""
    run = fit(tmp_path, Alternating(), [AutogradGraphLogger(batches=3)], max_steps=4)
    assert [image.step for image in events(run).Images("graph/autograd")] == [0, 1]
    texts = events(run).Tensors("autograd_graph/text/text_summary")
    assert [event.step for event in texts] == [0, 1]
    assert not torch.is_anomaly_enabled()


def test_graph_logger_warns_when_backward_bypasses_lightning(tmp_path: Path) -> None:
    class BareBackward(ManualClassifier):
        def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.loss(*batch).backward()
            optimizer.step()

    with pytest.warns(UserWarning, match=r"saw no backward .* self.manual_backward\(loss\)"):
        fit(tmp_path, BareBackward(), [AutogradGraphLogger()], max_steps=1)


def test_graph_logger_names_each_optimizers_graph_after_its_network(tmp_path: Path) -> None:
    """Two optimizers, one backward each per batch (a GAN's two phases): two graphs of the same
    shape over different parameters, each under its network's tags, once."""
    run = fit(tmp_path, TwoOptimizers(), [AutogradGraphLogger(batches=2)], max_steps=4)
    logged = events(run)
    assert {tag: [image.step for image in logged.Images(tag)]
            for tag in logged.Tags()["images"]} == {"graph/autograd/first": [0],
                                                     "graph/autograd/second": [0]}
    texts = [event.tensor_proto.string_val[0].decode()
             for event in logged.Tensors("autograd_graph/text/text_summary")]
    assert len(texts) == 2 and "AccumulateGrad (second.weight [1, 4])" in texts[1]


def test_graph_logger_rejects_bad_step() -> None:
    with pytest.raises(ValueError, match="at_step must be an int >= 0"):
        AutogradGraphLogger(at_step=-1)
    with pytest.raises(ValueError, match="batches must be an int >= 1"):
        AutogradGraphLogger(batches=0)


def test_the_picture_marks_the_gradients_graph_and_names_the_parameters() -> None:
    """Oracle: the double-backward nodes are those reachable from the gradient that the forward
    graph does not have (walked separately, without anomaly mode); TBackward0 is in both (the
    forward's W^T and the gradient's own transpose), so it is counted once more."""
    module = PlainClassifier()
    x, y = data()
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        points = as_points(x)
        per_sample = F.cross_entropy(module(points), y, reduction="none")
        (grad,) = torch.autograd.grad(per_sample.sum(), points, create_graph=True)
        loss = per_sample.mean() + grad.square().sum(1).mean()
    names, kinds, labels = node_kinds(autograd_graph(loss, dict(module.named_parameters())))

    forward = autograd_graph(per_sample).names()
    of_gradient = autograd_graph(grad).names()
    new = sorted(name for name in of_gradient if name not in forward)
    marked = sorted(name for name, kind in zip(names, kinds, strict=True)
                    if kind == "double_backward")
    assert marked == sorted([*new, "TBackward0"])
    assert new == ["LogSoftmaxBackwardDataBackward0", "MmBackward0", "NllLossBackwardBackward0"]
    assert sorted(labels.values()) == ["leaf [8, 4]", "net.bias", "net.weight"]
    assert (kinds.count("parameter"), kinds.count("leaf")) == (2, 1)


# What PenaltyWeightSchedule counts: the steps of the optimizer the penalty belongs to. In the
# GAN (manual optimization, n_critic critic steps per generator step) a critic penalty's ramp counts
# critic steps and a generator penalty's generator steps, not Lightning's global step (both).
GAN_BATCH, BATCHES, N_CRITIC = 4, 12, 3


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
    data = DataLoader(TensorDataset(torch.randn(GAN_BATCH * BATCHES, 2)), batch_size=GAN_BATCH)
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
