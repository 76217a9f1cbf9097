"""The classifier module: its step against the formulas, batch-split invariance under gradient
accumulation, the evaluation metrics, and the construction errors."""

from __future__ import annotations

import math
from functools import partial
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from gradreg import GradientError
from gradreg.evaluation.metrics import pgd
from gradreg.lightning.classifier import Classifier
from gradreg.models import MLP
from gradreg.penalties import make_penalty
from gradreg.penalties.guards.finite import _Recorded

IN, CLASSES, BATCH = 4, 3, 8


def data(n: int = BATCH, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    return torch.rand(n, IN, generator=rng, dtype=torch.float64), torch.arange(n) % CLASSES


def classifier(penalties: dict, **kwargs) -> Classifier:
    torch.manual_seed(0)
    return Classifier(MLP(IN, CLASSES, hidden=(5,), activation="tanh").double(), penalties,
                      **kwargs)


def trainer(**kwargs) -> L.Trainer:
    options = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False,
               "enable_checkpointing": False, "inference_mode": False}
    return L.Trainer(**{**options, **kwargs})


def test_step_is_task_loss_plus_the_penalty_formulas() -> None:
    model = classifier({
        "db": make_penalty("double_backprop", weight=0.5),
        "hidden": make_penalty("intermediate", weight=0.25, layers=["act1"]),
        "pgn": make_penalty("param_grad_norm", weight=0.1),
        "jac": make_penalty("jacobian", weight=2.0, count=CLASSES),
    })
    x, y = data()
    loss, penalties = model.losses(x, y)
    values = {name: float(value.detach()) for name, value in penalties.items()}

    net = model.backbone
    xg = x.clone().requires_grad_()
    hidden = net.act1(net.fc1(xg))
    per_sample = F.cross_entropy(net.out(hidden), y, reduction="none")
    dx, dh = torch.autograd.grad(per_sample.sum(), (xg, hidden), retain_graph=True)
    dtheta = torch.autograd.grad(per_sample.mean(), list(net.parameters()))
    jac = torch.func.vmap(torch.func.jacrev(net))(x.unsqueeze(1))  # [B, 1, C, 1, IN]
    assert float(loss.detach()) == pytest.approx(float(per_sample.mean().detach()))
    assert values["db"] == pytest.approx(0.5 * float(dx.square().sum(1).mean()))
    assert values["hidden"] == pytest.approx(0.25 * float(dh.square().sum(1).mean()))
    grad_norm = float(torch.cat([g.flatten() for g in dtheta]).norm())
    assert values["pgn"] == pytest.approx(0.1 * grad_norm)
    # all C orthonormal projections: the exact squared Frobenius norm of the Jacobian
    frobenius = float(jac.detach().flatten(1).square().sum(1).mean())
    assert values["jac"] == pytest.approx(2.0 * frobenius)


@pytest.mark.parametrize("options", [{"method": "finite_difference"}, {"subsample": 0.5},
                                     {"chunks": 3}])
def test_methods_that_run_their_own_forward_give_the_same_value(options: dict) -> None:
    x, y = data()
    n = 4 if "subsample" in options else BATCH  # subsample: the first half of the batch
    exact = classifier({"db": make_penalty("double_backprop")}).losses(x[:n], y[:n])[1]["db"]
    value = classifier({"db": make_penalty("double_backprop", **options)}).losses(x, y)[1]["db"]
    assert float(value.detach()) == pytest.approx(float(exact.detach()), rel=1e-6)


@pytest.mark.parametrize(("options", "tolerance"), [({"method": "finite_difference"}, 1e-6),
                                                   ({"chunks": 3}, 1e-12)])
def test_step_gradient_of_the_other_methods_matches_double_backward(options: dict,
                                                                    tolerance: float) -> None:
    """The parameter gradient of task + penalty, finite differences sharing the task's forward
    (float64: error 1e-6 stated) and chunks (exact)."""
    def step_gradient(penalty_options: dict) -> torch.Tensor:
        model = classifier({"db": make_penalty("double_backprop", weight=0.5, **penalty_options)})
        loss, penalties = model.losses(*data())
        grads = torch.autograd.grad(loss + sum(penalties.values()),
                                    list(model.backbone.parameters()))
        return torch.cat([g.flatten() for g in grads])

    exact, other = step_gradient({}), step_gradient(options)
    assert float((other - exact).norm() / exact.norm()) < tolerance


@pytest.mark.parametrize(("options", "forwards"), [
    ({}, 1), ({"method": "finite_difference"}, 2), ({"chunks": 2}, 3)])
def test_forward_passes_of_a_step(options: dict, forwards: int) -> None:
    """Double backward and finite differences share the task's forward at the inputs (finite
    differences add one at the shifted points); chunks run their own, one per micro-batch."""
    model = classifier({"db": make_penalty("double_backprop", **options)})
    calls = []
    model.backbone.register_forward_hook(lambda *_: calls.append(1))
    model.losses(*data())
    assert len(calls) == forwards


def test_lazy_penalty_is_computed_one_step_in_every() -> None:
    model = classifier({"db": make_penalty("double_backprop", every=3)})
    x, y = data()
    assert [list(model.losses(x, y)[1]) for _ in range(4)] == [["db"], [], [], ["db"]]


def test_accumulating_k_batches_equals_one_k_times_larger_batch() -> None:
    """SGD on 64 samples, two steps: 4 accumulated micro-batches of 8 == batches of 32."""
    dataset = TensorDataset(*data(n=64))
    models = {}
    for batch_size, accumulate in [(8, 4), (32, 1)]:
        models[batch_size] = model = classifier(
            {"db": make_penalty("double_backprop", weight=0.5),
             "hidden": make_penalty("intermediate", weight=0.3, layers=["act1"])},
            optimizer=partial(torch.optim.SGD, lr=0.5),
        )
        trainer(max_steps=2, accumulate_grad_batches=accumulate, limit_val_batches=0).fit(
            model, DataLoader(dataset, batch_size=batch_size))
    initial = classifier({}).backbone.state_dict()
    small, large = (models[b].backbone.state_dict() for b in (8, 32))
    for name in initial:
        assert torch.allclose(small[name], large[name], atol=1e-10, rtol=0), name
        assert not torch.allclose(small[name], initial[name], atol=1e-3)  # they did move
    assert (models[8].penalties["db"].steps_taken, models[32].penalties["db"].steps_taken) == (8, 2)


@pytest.mark.parametrize("points", ["inputs", "activations"])
def test_a_sum_penalty_over_accumulated_batches_is_the_sum_over_their_union(points: str) -> None:
    """reduction='sum': one SGD step on one batch of 8 == two accumulated batches of 4 (Lightning
    halves each micro-batch's loss; the sum is doubled back). Before, the penalty's part of the
    step was half as large."""
    dataset = TensorDataset(*data(n=8))
    options = {"layers": ["act1"]} if points == "activations" else {}
    name = "intermediate" if points == "activations" else "double_backprop"
    models = {}
    for batch_size, accumulate in [(4, 2), (8, 1)]:
        models[batch_size] = model = classifier(
            {"p": make_penalty(name, weight=3.0, reduction="sum", **options)},
            optimizer=partial(torch.optim.SGD, lr=1.0))
        trainer(max_steps=1, accumulate_grad_batches=accumulate, limit_val_batches=0).fit(
            model, DataLoader(dataset, batch_size=batch_size))
    without = classifier({}, optimizer=partial(torch.optim.SGD, lr=1.0))
    trainer(max_steps=1, limit_val_batches=0).fit(without, DataLoader(dataset, batch_size=8))
    split, whole, task = (m.backbone.state_dict() for m in (models[4], models[8], without))
    for key in split:
        torch.testing.assert_close(split[key], whole[key], rtol=0, atol=1e-12)
        assert not torch.allclose(whole[key], task[key], atol=1e-6)  # the penalty moved it


def test_a_sum_penalty_on_more_than_one_rank_is_refused() -> None:
    """DDP averages the ranks' gradients: a sum would become the mean of the ranks' sums."""
    model = classifier({"db": make_penalty("double_backprop", reduction="sum"),
                        "pg": make_penalty("param_grad_norm", reduction="sum")})
    model._trainer = SimpleNamespace(world_size=2, accumulate_grad_batches=1,
                                     strategy=DDPStrategy())
    with pytest.raises(ValueError, match=r"penalties \['db'\] sum over samples .* 2 ranks"):
        model.on_fit_start()
    model._trainer = SimpleNamespace(world_size=1, accumulate_grad_batches=1, strategy=None)
    model.on_fit_start()


def test_evaluation_metrics() -> None:
    x, y = data(n=16)
    model = classifier({}, fgsm_eps=0.0, optimizer=partial(torch.optim.Adam, lr=0.05))
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    trainer(max_steps=100, limit_val_batches=0).fit(model, loader)  # memorize the 16 samples
    metrics = trainer().validate(model, loader, verbose=False)[0]
    xg = x.clone().requires_grad_()
    per_sample = F.cross_entropy(model.backbone(xg), y, reduction="none")
    (grad,) = torch.autograd.grad(per_sample.sum(), xg)
    accuracy = float((model.backbone(x).argmax(1) == y).double().mean())
    assert metrics["val/acc"] == pytest.approx(accuracy)
    assert metrics["val/acc_fgsm"] == pytest.approx(accuracy)  # eps = 0: no attack
    assert metrics["val/acc_pgd"] == pytest.approx(accuracy)
    assert metrics["val/input_grad_norm"] == pytest.approx(float(grad.norm(dim=1).mean()))
    assert metrics["val/loss"] == pytest.approx(float(per_sample.mean().detach()))

    model.fgsm_eps = 0.3
    attacked = trainer().validate(model, loader, verbose=False)[0]
    adversarial = (x + 0.3 * grad.sign()).clamp(0, 1)
    expected = float((model.backbone(adversarial).argmax(1) == y).double().mean())
    assert attacked["val/acc_fgsm"] == pytest.approx(expected)
    assert accuracy == 1.0 and expected < 0.5  # the attack changed predictions
    # PGD, 10 steps with the random start of batch 0, is the stronger attack here
    with torch.enable_grad():
        strong = pgd(lambda q: F.cross_entropy(model.backbone(q), y, reduction="sum"), x, 0.3,
                     steps=10, bounds=(0, 1), generator=torch.Generator().manual_seed(0))
    expected_pgd = float((model.backbone(strong).argmax(1) == y).double().mean())
    assert attacked["val/acc_pgd"] == pytest.approx(expected_pgd)
    assert expected_pgd <= expected


def test_evaluation_under_inference_mode_says_what_to_set() -> None:
    loader = DataLoader(TensorDataset(*data()), batch_size=BATCH)
    with pytest.raises(RuntimeError, match="inference_mode=False"):
        trainer(inference_mode=True).validate(classifier({}), loader, verbose=False)


@pytest.mark.parametrize("preset", ["wgan_gp", "r1", "dragan", "path_length"])
def test_critic_and_generator_penalties_are_refused(preset: str) -> None:
    with pytest.raises(ValueError, match=(
            rf"penalty '{preset}' has points='\w+', which a Classifier cannot evaluate; a "
            r"Classifier supports points \['inputs', 'activations', 'parameters'\], i.e. the "
            r"presets \['double_backprop', 'intermediate', 'jacobian', 'param_grad_norm', "
            r"'sam', 'asam', 'gr', 'derivative', 'spectral'\]")):
        classifier({preset: make_penalty(preset)})


def test_unknown_layer_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"layers=\['act9'\].*valid layers: \['flatten', 'fc1'"):
        classifier({"hidden": make_penalty("intermediate", layers=["act9"])})


@pytest.mark.parametrize("options", [{"chunks": 2}, {"subsample": 0.5}])
def test_own_forward_options_on_activations_are_refused_at_construction(options: dict) -> None:
    with pytest.raises(ValueError, match=r"penalty 'hidden' \(points='activations'\) asks for "
                                         r"its own forward pass.*use subsample=1 and chunks=1"):
        classifier({"hidden": make_penalty("intermediate", layers=["act1"], **options)})


def test_epoch_end_settles_pending_finite_checks() -> None:
    """A NaN penalty whose (GPU, asynchronous) check is still pending is raised at the end of the
    training epoch at the latest; here a pending record stands in for the device copy."""
    module = classifier({"db": make_penalty("double_backprop")})
    module.penalties["db"].finite_check._recorded.append(
        _Recorded(7, torch.tensor(float("nan")), lambda: False, lambda: None))
    with pytest.raises(GradientError, match="penalty of call 7 is nan"):
        module.on_train_epoch_end()


def test_sam_trains_with_the_gradient_at_the_ascent_point() -> None:
    """One Lightning step of a Classifier with ``sam(0.05)`` (SGD, lr 0.1), against davda54/sam's
    two steps written here: the parameters after it agree to float rounding. The step takes
    the task's gradient inside the penalty (two forwards, two backwards)."""
    x, y = data()
    module = classifier({"sam": make_penalty("sam")},
                        optimizer=partial(torch.optim.SGD, lr=0.1))
    reference = classifier({})
    params = list(reference.parameters())
    F.cross_entropy(reference(x), y).backward()
    norm = torch.sqrt(sum(p.grad.square().sum() for p in params))
    with torch.no_grad():
        shifts = [p.grad * (0.05 / norm) for p in params]
        for p, e in zip(params, shifts, strict=True):
            p.add_(e)
    reference.zero_grad()
    F.cross_entropy(reference(x), y).backward()
    with torch.no_grad():
        for p, e in zip(params, shifts, strict=True):
            p.sub_(e).sub_(0.1 * p.grad)
    trainer(max_steps=1).fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    for got, want in zip(module.backbone.parameters(), params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("options", [{"method": "finite_difference", "step": 1e-4}, {}],
                         ids=["finite_difference", "double_backward"])
def test_a_parameter_penalty_under_accumulation_is_that_of_the_accumulated_batch(
        options: dict) -> None:
    """SGD on 32 samples, three steps: 2 accumulated micro-batches of 8 == batches of 16 (float
    rounding), with the step of a batch of 16 taken by the same penalty. Each micro-batch
    penalizing its own gradient ends 0.148 away (measured in the plain loop of
    tests/penalties/test_two_pass.py)."""
    dataset = TensorDataset(*data(n=32))
    models = {}
    for batch_size, accumulate in [(8, 2), (16, 1)]:
        models[batch_size] = model = classifier(
            {"gnp": make_penalty("param_grad_norm", weight=0.5, **options)},
            optimizer=partial(torch.optim.SGD, lr=0.5))
        trainer(max_steps=3, accumulate_grad_batches=accumulate, limit_val_batches=0).fit(
            model, DataLoader(dataset, batch_size=batch_size))
    initial = classifier({}).backbone.state_dict()
    small, large = (models[b].backbone.state_dict() for b in (8, 16))
    # Float rounding, as tests/penalties/test_two_pass.py derives it: the batches sum their
    # samples in another order (and the CPU's vectorization in its own), a few eps * max|g| per
    # gradient entry, amplified by λ/step = 5000 in the finite difference, times lr x steps.
    # Allowed: 16 eps (measured 0.9-1.8 eps with AVX-512, AVX2 and unvectorized kernels).
    x, y = dataset.tensors
    start = classifier({})
    largest = max(g.abs().max().item() for g in torch.autograd.grad(
        F.cross_entropy(start(x[:16]), y[:16]), list(start.parameters())))
    amplification = 0.5 / options["step"] if "step" in options else 1.0
    bound = 16 * torch.finfo(torch.float64).eps * (1 + amplification) * largest * 0.5 * 3
    for name in initial:
        torch.testing.assert_close(small[name], large[name], rtol=0, atol=bound)
        assert not torch.allclose(small[name], initial[name], atol=1e-3)  # they did move


def test_two_parameter_penalties_under_ddp_are_refused() -> None:
    """Each takes the whole batch's gradient over the ranks with the task's: one at a time."""
    model = classifier({"a": make_penalty("sam"), "b": make_penalty("param_grad_norm")})
    model._trainer = SimpleNamespace(world_size=2, accumulate_grad_batches=1,
                                     strategy=DDPStrategy())
    with pytest.raises(ValueError, match=r"penalties \['a', 'b'\] with DDP over 2 ranks: the "
                                         r"penalty of the whole batch's gradient .* one "):
        model.on_fit_start()
    model._trainer.world_size = 1
    model.on_fit_start()


def test_two_parameter_penalties_under_accumulation_are_refused() -> None:
    model = classifier({"a": make_penalty("sam"), "b": make_penalty("param_grad_norm")})
    with pytest.raises(ValueError, match=r"penalties \['a', 'b'\] with "
                                         r"accumulate_grad_batches=2: .* for one parameter"):
        trainer(max_steps=1, accumulate_grad_batches=2).fit(
            model, DataLoader(TensorDataset(*data()), batch_size=4))


# Classifier's attack radius ``fgsm_eps``: a finite number >= 0. A negative one steps down the
# loss, so that the "adversarial" accuracy came out above the clean one, a result that looked like
# robustness.

@pytest.mark.parametrize("eps", [-1, -1e-3, math.nan, math.inf, True, "0.1"])
def test_an_fgsm_eps_that_is_not_a_finite_number_at_least_0_is_refused(eps: object) -> None:
    with pytest.raises(ValueError, match=r"fgsm_eps must be a finite number >= 0 \(the L-inf "
                                         rf"radius of the attacks\), got {eps!r}"):
        Classifier(MLP(4, 3, hidden=(5,)), fgsm_eps=eps)


@pytest.mark.parametrize("eps", [0, 0.0, 0.1, 8 / 255])
def test_an_fgsm_eps_of_0_or_more_is_taken(eps: float) -> None:
    assert Classifier(MLP(4, 3, hidden=(5,)), fgsm_eps=eps).fgsm_eps == eps


def test_a_batchnorm_backbone_with_two_due_penalties_equals_the_exact_step() -> None:
    """double_backprop and GNP by finite difference on a BatchNorm backbone (train mode): the
    forward at the shifted parameters leaves the running statistics the step's graph saved (it
    raised "modified by an inplace operation"); the step's gradient is that of GNP by double
    backward to O(step), and the statistics are those of one forward."""
    x, y = data()

    def step(method: dict) -> tuple[list[torch.Tensor], torch.nn.Module]:
        torch.manual_seed(0)
        backbone = torch.nn.Sequential(torch.nn.Linear(IN, 6), torch.nn.BatchNorm1d(6),
                                       torch.nn.Tanh(), torch.nn.Linear(6, CLASSES)).double()
        model = Classifier(backbone, {
            "db": make_penalty("double_backprop", weight=0.5),
            "gnp": make_penalty("param_grad_norm", weight=0.1, **method)})
        loss, penalties = model.losses(x, y)
        (loss + sum(penalties.values())).backward()
        return [p.grad for p in backbone.parameters()], backbone[1]

    estimate, norm = step({"method": "finite_difference", "step": 1e-6})
    exact, exact_norm = step({})
    for a, b in zip(estimate, exact, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(norm.running_mean, exact_norm.running_mean, rtol=0, atol=0)
    assert int(norm.num_batches_tracked) == 1
