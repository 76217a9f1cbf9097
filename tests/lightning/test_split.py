"""GradientSplit: per layer, the task's and the penalties' parts of the parameter gradient, checked
against an independent computation and against the ``.grad`` the optimizer applies."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradreg.lightning.callbacks import GradientSplit
from gradreg.lightning.callbacks.split import split_norms
from gradreg.lightning.classifier import Classifier
from gradreg.lightning.gan import GAN
from gradreg.models import MLP
from gradreg.penalties import double_backprop, make_penalty, sam
from tests.lightning.helpers import PlainClassifier, events, fit, loader, trainer


class Recorder(pl.Callback):
    """The module before each step and the batch (to recompute the parts), and the ``.grad``
    the optimizer is about to apply."""

    def __init__(self) -> None:
        self.before: list[tuple[nn.Module, Any]] = []
        self.grads: list[dict[str, Tensor]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self.before.append((copy.deepcopy(pl_module.backbone), batch))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self.grads.append({name: param.grad.clone()
                           for name, param in pl_module.named_parameters()})


def sam_gradients_by_hand(model: nn.Module, x: Tensor, y: Tensor, rho: float
                          ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The cross-entropy gradient g of ``model`` at its parameters and at theta + rho g/|g|
    (SAM's two passes written out; ``model``'s parameters are left shifted)."""
    params = list(model.parameters())
    g = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    norm = torch.sqrt(sum(t.square().sum() for t in g))
    with torch.no_grad():
        for p, t in zip(params, g, strict=True):
            p.add_(t * (rho / norm))
    return g, torch.autograd.grad(F.cross_entropy(model(x), y), params)


def digits_like() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(24, 6, generator=generator, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.arange(24) % 3), batch_size=8)


def test_the_parts_sum_to_the_applied_gradient_and_their_norms_are_logged(tmp_path: Path
                                                                          ) -> None:
    """A float64 Classifier with double backprop (weight 0.5), SGD, 3 steps, split at each: the
    task part (autograd of the mean cross-entropy alone, recomputed from the module as it was
    before the step) plus the penalty part (of 0.5 * P alone) is the .grad of the step, and
    the logged norms, share and cosine are those of the recomputed parts."""
    torch.manual_seed(0)
    backbone = MLP(6, 3, hidden=[5]).double()
    module = Classifier(backbone, {"gp": double_backprop(weight=0.5)}, pgd_steps=0,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    recorder = Recorder()
    run = trainer(tmp_path, [GradientSplit(every_n_steps=1), recorder], max_steps=3)
    run.fit(module, digits_like())
    logged = events(run)
    layers = ["backbone.fc1", "backbone.out"]
    for step, ((before, (x, y)), applied) in enumerate(zip(recorder.before, recorder.grads,
                                                           strict=True)):
        twin = Classifier(before, {"gp": double_backprop(weight=0.5)}, pgd_steps=0)
        task, penalties = twin.losses(x, y)
        names = [name for name, _ in twin.named_parameters()]
        params = list(twin.parameters())
        task_part = dict(zip(names, torch.autograd.grad(task, params, retain_graph=True),
                             strict=True))
        penalty_part = dict(zip(names, torch.autograd.grad(penalties["gp"], params),
                                strict=True))
        for name in names:
            torch.testing.assert_close(task_part[name] + penalty_part[name], applied[name])
        for layer in layers:
            t = torch.cat([task_part[n].flatten() for n in names if n.startswith(layer + ".")])
            p = torch.cat([penalty_part[n].flatten() for n in names
                           if n.startswith(layer + ".")])
            expected = {"task": t.norm(), "penalty": p.norm(),
                        "penalty_share": p.norm() / (t.norm() + p.norm()),
                        "cosine": (t @ p) / (t.norm() * p.norm())}
            for quantity, value in expected.items():
                (event,) = [e for e in logged.Scalars(f"grad_split/{quantity}/{layer}")
                            if e.step == step]
                assert event.value == pytest.approx(float(value), rel=1e-5)
    assert 0 < logged.Scalars("grad_split/penalty_share/backbone.fc1")[0].value < 1


def test_a_gan_splits_each_phase_over_its_own_network(tmp_path: Path) -> None:
    """WGAN-GP (weight 10) on 2D points, n_critic 1: the critic's layers get a penalty part; the
    generator's loss has no penalty, so its layers log their task part only (no penalty part,
    share or cosine: none is defined)."""
    torch.manual_seed(0)
    module = GAN(MLP(2, 2, hidden=[4]), MLP(2, 1, hidden=[4]),
                 {"wgan_gp": make_penalty("wgan_gp", weight=10.0)}, n_critic=1)
    points = DataLoader(TensorDataset(torch.randn(32, 2)), batch_size=8)
    run = trainer(tmp_path, [GradientSplit(every_n_steps=1)], max_steps=4)
    run.fit(module, points)
    scalars = events(run).Tags()["scalars"]
    split = sorted(tag for tag in scalars if tag.startswith("grad_split/penalty/"))
    assert split == ["grad_split/penalty/critic.fc1", "grad_split/penalty/critic.out"]
    assert not [tag for tag in scalars if tag.startswith("grad_split/") and "generator" in tag
                and not tag.startswith("grad_split/task/")]
    generator = [e.value for e in events(run).Scalars("grad_split/task/generator.fc1")]
    critic = [e.value for e in events(run).Scalars("grad_split/penalty/critic.fc1")]
    assert generator and all(value > 0 for value in generator)
    assert critic and all(value > 0 for value in critic)
    assert GradientSplit().split_layers(module) == ["generator.fc1", "generator.out",
                                                    "critic.fc1", "critic.out"]


def test_undefined_shares_and_cosines_are_not_logged_as_zero() -> None:
    """Task part (3, 4), penalty part (0, 0): norms 5 and 0, share 0 / 5 = 0, no cosine (a zero
    part has no direction); both parts zero: no share either; no penalty computed: the task
    norm alone. Task (3, 4), penalty (-4, 3): share 5 / 10, cosine 0 (orthogonal, defined)."""
    zero, task = torch.zeros(2), torch.tensor([3.0, 4.0])
    assert split_norms({"a": (task, zero), "b": (zero, zero), "c": (task, None),
                        "d": (task, torch.tensor([-4.0, 3.0]))}) == {
        "grad_split/task/a": 5.0, "grad_split/penalty/a": 0.0, "grad_split/penalty_share/a": 0.0,
        "grad_split/task/b": 0.0, "grad_split/penalty/b": 0.0,
        "grad_split/task/c": 5.0,
        "grad_split/task/d": 5.0, "grad_split/penalty/d": 5.0, "grad_split/penalty_share/d": 0.5,
        "grad_split/cosine/d": 0.0}


def test_a_module_that_records_no_terms_is_told_how(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"GradientSplit got no loss terms from PlainClassifier"):
        fit(tmp_path, PlainClassifier(), [GradientSplit(every_n_steps=1)])
    assert loader()  # the run itself trained


def test_the_interval_is_checked() -> None:
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
        GradientSplit(every_n_steps=0)


# GradientSplit on a Classifier whose parameter penalty takes the task's gradient (two passes):
# the terms are split for the callback, and the step's gradient is still SAM's.
def test_a_split_sam_step_is_sams_gradient_and_its_parts_are_logged(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Classifier(MLP(6, 3, hidden=[5]).double(), {"sam": sam(0.05)}, pgd_steps=0,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    recorder = Recorder()
    run = trainer(tmp_path, [GradientSplit(every_n_steps=1), recorder], max_steps=2)
    run.fit(module, digits_like())
    for (before, (x, y)), applied in zip(recorder.before, recorder.grads, strict=True):
        _, ascent = sam_gradients_by_hand(before, x, y, 0.05)
        names = [name for name, _ in before.named_parameters()]
        for name, want in zip(names, ascent, strict=True):
            torch.testing.assert_close(applied[f"backbone.{name}"], want, rtol=1e-10,
                                       atol=1e-13)
    logged = events(run)
    assert len(logged.Scalars("grad_split/penalty_share/backbone.fc1")) == 2
