"""One training step's terms (:func:`step_terms`) against references written here in float64:
double backward of the penalties' formulas, SAM's gradient by hand, and the whole batch for a
:class:`Window` of micro-batches."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradreg import GradientError
from gradreg.penalties import (
    EngineBackward,
    GeneratorState,
    StepForward,
    Window,
    double_backprop,
    gr,
    param_grad_norm,
    penalty_terms,
    r1,
    sam,
    step_terms,
)

CE = partial(F.cross_entropy, reduction="none")
LAMBDA, RHO = 0.3, 0.05


def problem() -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    return model, torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))


def flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.flatten() for t in tensors])


def step_gradient(model: nn.Module, penalties: dict, x: Tensor, y: Tensor, *,
                  window: Window | None = None, parts: int = 1) -> tuple[Tensor, dict]:
    """``.grad`` after one step of ``parts`` micro-batches (each backward of 1/parts of the
    total), and the penalties' values (those of the last micro-batch that has them)."""
    model.zero_grad()
    values = {}
    for k, (xb, yb) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
        terms = step_terms(penalties, model, CE, xb, yb, accumulation=window,
                           last=k == parts - 1)
        (terms.total() / parts).backward()
        values.update({name: value.detach() for name, value in terms.penalties.items()})
    return flat([p.grad for p in model.parameters()]), values


def parameter_oracle(penalty: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    """The gradient of :math:`L + P(\\nabla_\\theta L)` by double backward."""

    def oracle(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        params = list(model.parameters())
        loss = F.cross_entropy(model(x), y)
        g = flat(torch.autograd.grad(loss, params, create_graph=True))
        return flat(torch.autograd.grad(loss + penalty(g), params))

    return oracle


def input_oracle(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    r""":math:`L + \lambda\,\mathrm{mean}_i \lVert \nabla_{x_i} \ell_i \rVert^2` by double
    backward."""
    x = x.clone().requires_grad_()
    losses = CE(model(x), y)
    (g,) = torch.autograd.grad(losses.sum(), x, create_graph=True)
    total = losses.mean() + LAMBDA * g.square().sum(1).mean()
    return flat(torch.autograd.grad(total, list(model.parameters())))


def sam_oracle(model: nn.Module, x: Tensor, y: Tensor, shifted: int | None = None) -> Tensor:
    r"""SAM's step by hand: :math:`\nabla L(\theta + \rho\, g / \lVert g \rVert)`; with
    ``shifted``, of the first ``shifted`` parameters :math:`\theta_S` alone (:math:`g` theirs,
    the others' gradient :math:`\nabla L(\theta)`)."""
    params = list(model.parameters())
    g = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    chosen = slice(shifted)
    norm = flat(list(g[chosen])).norm()
    with torch.no_grad():
        for p, d in zip(params[chosen], g[chosen], strict=True):
            p.add_(d, alpha=RHO / norm.item())
    at_shift = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    with torch.no_grad():
        for p, d in zip(params[chosen], g[chosen], strict=True):
            p.sub_(d, alpha=RHO / norm.item())
    return flat([*at_shift[chosen], *g[len(g[chosen]):]])


CASES = {  # the penalty, the oracle of the step's gradient, the absolute tolerance (float64:
    # float rounding where the oracle is the same computation; the finite difference's error at
    # its default step, 2e-8 here, against its double backward)
    "double_backprop": (lambda: double_backprop(LAMBDA), input_oracle, 1e-13),
    "sam": (lambda: sam(RHO), sam_oracle, 1e-13),
    "gnp": (lambda: param_grad_norm(LAMBDA, method="finite_difference"),
            parameter_oracle(lambda g: LAMBDA * g.norm()), 1e-7),
    "gr": (lambda: gr(LAMBDA), parameter_oracle(lambda g: LAMBDA / 2 * g.square().sum()), 1e-7),
}


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_steps_gradient_is_the_oracles(case: str, parts: int) -> None:
    """One batch, or a window of two micro-batches: the step's gradient is the whole batch's
    (float64; the finite differences within their step's error)."""
    build, oracle, tolerance = CASES[case]
    model, x, y = problem()
    expected = oracle(model, x, y)
    window = Window(parts) if parts > 1 else None
    got, values = step_gradient(model, {"p": build()}, x, y, window=window, parts=parts)
    assert list(values) == ["p"]
    assert expected.abs().max() > 0.1  # the tolerances are small against the gradient
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=tolerance)


def test_the_penalties_value_is_the_whole_batchs_and_the_task_term_is_the_loss() -> None:
    """The value of a parameter penalty in a window is that of the whole batch's gradient; the
    task term's value is the micro-batch's mean loss."""
    model, x, y = problem()
    params = list(model.parameters())
    norm = flat(list(torch.autograd.grad(F.cross_entropy(model(x), y), params))).norm()
    _, values = step_gradient(model, {"p": param_grad_norm(LAMBDA, method="finite_difference")},
                              x, y, window=Window(2), parts=2)
    torch.testing.assert_close(values["p"], LAMBDA * norm, rtol=1e-12, atol=0)
    terms = step_terms({}, model, CE, x, y)
    torch.testing.assert_close(terms.task, F.cross_entropy(model(x), y), rtol=0, atol=0)
    assert terms.penalties == {} and terms.outputs.shape == (16, 3)


def test_two_penalties_share_one_forward() -> None:
    """An input penalty and a parameter penalty in two passes on one forward: the sum of their
    oracles' penalty gradients."""
    model, x, y = problem()
    task = flat(list(torch.autograd.grad(F.cross_entropy(model(x), y),
                                         list(model.parameters()))))
    expected = input_oracle(model, x, y) + sam_oracle(model, x, y) - task
    got, values = step_gradient(model, {"db": double_backprop(LAMBDA), "sam": sam(RHO)}, x, y)
    assert sorted(values) == ["db", "sam"]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_a_lazy_penalty_is_left_out_when_not_due() -> None:
    model, x, y = problem()
    penalties = {"db": double_backprop(LAMBDA, every=2)}
    assert [sorted(step_terms(penalties, model, CE, x, y).penalties) for _ in range(3)] == [
        ["db"], [], ["db"]]


def test_a_gan_penalty_is_refused_in_one_line() -> None:
    model, x, y = problem()
    with pytest.raises(GradientError, match=r"\['r1'\] are at a GAN's points"):
        step_terms({"r1": r1()}, model, CE, x, y)


def test_what_a_window_cannot_take_is_refused_in_one_line() -> None:
    """No micro-batches; two parameter penalties, or a lazy one over micro-batches (each would
    count a step); a micro-batch that does not say whether it is the last."""
    model, x, y = problem()
    with pytest.raises(GradientError, match="integer >= 1"):
        Window(0)
    with pytest.raises(GradientError, match="for one parameter penalty"):
        step_terms({"a": sam(RHO), "b": gr(LAMBDA)}, model, CE, x, y, accumulation=Window(2),
                   last=True)
    with pytest.raises(GradientError, match=r"lazy \(every > 1\)"):
        step_terms({"a": sam(RHO, every=2)}, model, CE, x, y, accumulation=Window(2), last=True)
    with pytest.raises(GradientError, match="maxima over micro-batches"):
        step_terms({"a": double_backprop(LAMBDA, reduction="max")}, model, CE, x, y,
                   accumulation=Window(2), last=True)
    with pytest.raises(GradientError, match="needs last=True"):
        step_terms({"a": sam(RHO)}, model, CE, x, y, accumulation=Window(2))


@pytest.mark.parametrize("parts", [1, 2])
def test_parameters_outside_the_penalty_take_the_tasks_gradient(parts: int) -> None:
    """SAM of the first layer alone (``params``): the first layer's gradient at the layer's
    shift, the last layer's the task's own (which the two passes would otherwise drop)."""
    model, x, y = problem()
    expected = sam_oracle(model, x, y, shifted=2)
    model.zero_grad()
    window = Window(parts) if parts > 1 else None
    for k, (xb, yb) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
        terms = step_terms({"sam": sam(RHO)}, model, CE, xb, yb,
                           params=list(model[0].parameters()), accumulation=window,
                           last=k == parts - 1)
        (terms.total() / parts).backward()
    got = flat([p.grad for p in model.parameters()])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert (got - sam_oracle(model, x, y)).abs().max() > 1e-4  # not SAM of all parameters


def test_penalties_at_activations_are_of_the_outputs_where_they_say() -> None:
    r"""``of="outputs"`` at the hidden layer: :math:`\lambda\,\mathrm{mean}_i \lVert
    \nabla_{h_i} \textstyle\sum_c f(x_i)_c \rVert^2`, by double backward here."""
    model, x, y = problem()
    hidden = model[0](x)
    outputs = model[2](model[1](hidden))
    (g,) = torch.autograd.grad(outputs.sum(), hidden, create_graph=True)
    total = CE(outputs, y).mean() + LAMBDA * g.square().sum(1).mean()
    expected = flat(list(torch.autograd.grad(total, list(model.parameters()))))
    penalty = double_backprop(LAMBDA, points="activations", layers=["0"], of="outputs")
    got, _ = step_gradient(model, {"p": penalty}, x, y)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("parts", [1, 2])
def test_an_engines_window_runs_its_own_first_phase(parts: int) -> None:
    """A window whose task loss only the caller's backward differentiates (DeepSpeed's):
    the task term is the loss itself plus the penalty's gradient, and the step is SAM's."""
    model, x, y = problem()
    expected = sam_oracle(model, x, y)
    window = Window(parts, engine=EngineBackward())
    got, _ = step_gradient(model, {"p": sam(RHO)}, x, y, window=window, parts=parts)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_a_normalized_window_takes_losses_that_sum_to_the_batchs() -> None:
    r"""Micro-batch losses normalized over the window's batch (:math:`\sum_{i \in k}
    \ell_i / B`, as Hugging Face's trainer divides by ``num_items_in_batch``), each backward of
    the terms as they are: SAM and double backprop of the whole batch (the sum of their
    oracles' penalty gradients)."""
    model, x, y = problem()
    params = list(model.parameters())
    task = flat(list(torch.autograd.grad(F.cross_entropy(model(x), y), params)))
    expected = input_oracle(model, x, y) + sam_oracle(model, x, y) - task
    window = Window(2, normalized=True)
    penalties = {"db": double_backprop(LAMBDA), "sam": sam(RHO)}
    model.zero_grad()
    for k, (xb, yb) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
        state = GeneratorState.capture(xb)
        points = xb.clone().requires_grad_()
        outputs = model(points)
        losses = CE(outputs, yb)

        def again(xb: Tensor = xb, yb: Tensor = yb) -> Tensor:
            return CE(model(xb), yb).sum() / len(x)

        forward = StepForward(losses.sum() / len(x), outputs, losses, state, again,
                              points=points, losses_at=lambda p, t: CE(model(p), t),
                              point_args=(yb,))
        penalty_terms(penalties, forward, params, window=window, last=k == 1).total().backward()
    torch.testing.assert_close(flat([p.grad for p in params]), expected, rtol=1e-10,
                               atol=1e-12)
