"""The mistakes a user makes with a penalty, each refused with an error that names the fix:
NaN/Inf in the batch, a batch-mean output, a weight that overflows, empty batches, integer data,
non-scalar penalties; and the coefficient of WGAN-GP's interpolation, on either side."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradreg
from gradreg import GradientError
from gradreg.penalties import (
    PRESETS,
    as_points,
    derivative,
    double_backprop,
    interpolate,
    jacobian,
    make_penalty,
    param_grad_norm,
    path_length,
    perturb_dragan,
    presets,
    r1,
    wgan_gp,
)
from gradreg.penalties.guards.finite import FiniteCheck, _Recorded


def critic(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)


def batch_with_one_inf() -> torch.Tensor:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    x[5, 2] = float("inf")
    return as_points(x)


@pytest.mark.parametrize("preset", [r1, wgan_gp, jacobian, derivative])
def test_one_inf_in_the_batch_raises_instead_of_returning_a_number(preset) -> None:
    """Before: r1 returned 0.1758 and 8 of 48 parameter-gradient entries were NaN."""
    D, x = critic(), batch_with_one_inf()
    with pytest.raises(GradientError, match="points of call 1 contain NaN or Inf"):
        preset()(D(x), x)


def test_one_inf_raises_for_double_backprop_too() -> None:
    D, x = critic(), batch_with_one_inf()
    loss_i = F.softplus(D(x)).squeeze(1)
    with pytest.raises(GradientError, match="points of call 1 contain NaN or Inf"):
        double_backprop()(loss_i, x)


@pytest.mark.parametrize("options", [{"chunks": 4}, {"subsample": 0.5},
                                     {"method": "finite_difference"}])
def test_one_inf_raises_on_the_paths_with_their_own_forward(options: dict) -> None:
    D, x = critic(), batch_with_one_inf()
    with pytest.raises(GradientError, match="points of call 1 contain NaN or Inf"):
        r1(**options)(D, x)


def test_non_finite_outputs_of_finite_points_are_named() -> None:
    x = as_points(torch.rand(4, 3))
    with pytest.raises(GradientError, match="outputs of call 1 contain NaN or Inf although"):
        r1()(torch.log(x - 2).sum(1), x)  # log of a negative number


def test_a_weight_that_overflows_float16_is_caught_after_weighting() -> None:
    """Before: the check read the value before the weight; r1(weight=1e30) on a float16 critic
    returned inf and 48/48 NaN gradients."""
    D = critic(torch.float16)
    x = as_points(torch.randn(16, 4).half())
    with pytest.raises(GradientError, match=r"is inf after weighting .* weight \* every \* gain "
                                            r"= 5e\+29"):
        r1(weight=1e30)(D(x), x)


@pytest.mark.parametrize("preset", [r1, double_backprop])
def test_a_batch_mean_output_is_refused_saying_what_to_pass(preset) -> None:
    """The gradient of a mean is 1/B of each sample's: the penalty was 256 times too small at
    B = 16. The per-sample value below is that factor times the mean's, by hand."""
    D = critic()
    x = as_points(torch.randn(16, 4))
    with pytest.raises(GradientError, match=r"outputs are a scalar, but the points are a batch of "
                                            r"16 .* D\(x\) rather than D\(x\)\.mean\(\) or "
                                            r"D\(x\)\.sum\(\).* 16² times too small"):
        preset()(D(x).mean(), x)
    per_sample = preset()(D(x), x, )
    (g_mean,) = torch.autograd.grad(D(x).mean(), x)
    assert per_sample.item() == pytest.approx(
        256 * preset().config.gain * preset().weight * g_mean.square().sum(1).mean().item(),
        rel=1e-5)


def test_a_batch_sum_output_is_refused_naming_the_sum() -> None:
    """gigagan-pytorch passes D(x).sum(): its gradient is each sample's only where the samples do
    not interact, which a scalar does not let the penalty check; the message names the sum and
    what to pass, not only a mean's B² factor."""
    D = critic()
    x = as_points(torch.randn(16, 4))
    with pytest.raises(GradientError, match=r"D\(x\)\.sum\(\).* that of a batch sum is each "
                                            r"sample's own only where the samples do not interact"):
        r1()(D(x).sum(), x)


@pytest.mark.parametrize("build", [lambda: double_backprop(0.1),
                                   lambda: double_backprop(0.1, chunks=2),
                                   lambda: make_penalty("intermediate", layers=("0",))],
                         ids=["double_backprop", "chunks", "intermediate"])
def test_logits_given_to_a_penalty_of_per_sample_losses_are_refused(build) -> None:
    """double_backprop(0.1)(logits [B, C], x) penalized the gradient of the summed logits, not of
    the loss; the per-sample losses [B] (and [B, 1]) are taken."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = as_points(torch.randn(6, 4)), torch.tensor([0, 1, 2, 0, 1, 2])
    gp = build()
    outputs = model if gp.needs_callable else model(x)
    # with chunks=2 the check sees each chunk of 3 samples
    with pytest.raises(GradientError, match=r"shape \([36], 3\), but this penalty is of "
                                            r"per-sample losses \(of='loss'\), one per sample "
                                            r"\(\[[36]\]\).*reduction='none'"):
        gp(outputs, x)
    losses = F.cross_entropy(model(x), y, reduction="none")
    (g,) = torch.autograd.grad(losses.sum(), x, create_graph=True)
    expected = 0.1 * g.square().sum(1).mean()  # 0.1 mean_i |d l_i / d x_i|^2, by hand
    assert double_backprop(0.1)(losses, x).item() == pytest.approx(expected.item(), rel=1e-6)
    assert double_backprop(0.1)(losses[:, None], x).item() == pytest.approx(expected.item(),
                                                                            rel=1e-6)


@pytest.mark.parametrize("method", ["finite_difference", "perturbation"])
def test_logits_from_the_callable_of_an_approximate_method_are_refused(method: str) -> None:
    """The methods that run the callable themselves check what it returns too: logits [B, 3]
    from a double backprop by finite difference or perturbation are refused; the per-sample
    losses of the same model give the exact value 0.1 mean_i |d l_i / d x_i|^2 (by hand)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = as_points(torch.randn(6, 4, dtype=torch.float64)), torch.tensor([0, 1, 2, 0, 1, 2])
    gp = double_backprop(0.1, method=method)
    with pytest.raises(GradientError, match=r"shape \(6, 3\), but this penalty is of per-sample "
                                            r"losses .*reduction='none'"):
        gp(model, x)
    if method == "finite_difference":  # its value is exact; the perturbation's an estimate
        losses = F.cross_entropy(model(x), y, reduction="none")
        (g,) = torch.autograd.grad(losses.sum(), x)
        value = gp(lambda q, labels: F.cross_entropy(model(q), labels, reduction="none"), x,
                   fn_args=(y,))
        assert value.item() == pytest.approx(0.1 * g.square().sum(1).mean().item(), rel=1e-10)


def test_outputs_of_another_batch_size_are_refused() -> None:
    x = as_points(torch.randn(8, 4))
    with pytest.raises(GradientError, match=r"shape \(4, 1\), but the points are a batch of 8 "
                                            r"samples: pass the outputs computed from these"):
        r1()(critic()(x)[:4], x)


def test_a_scalar_output_of_one_sample_is_its_own_per_sample_value() -> None:
    x = as_points(torch.randn(1, 4))
    D = critic()
    assert r1()(D(x).squeeze(), x).item() == pytest.approx(r1()(D(x), x).item(), rel=1e-7)


def test_param_grad_norm_on_an_empty_batch_raises() -> None:
    """Before: 0.0 while the loss was NaN."""
    net = nn.Linear(3, 2)
    loss = F.cross_entropy(net(torch.zeros(0, 3)), torch.zeros(0, dtype=torch.long))
    with pytest.raises(GradientError, match="outputs of call 1 contain NaN.*empty batch"):
        param_grad_norm()(loss, list(net.parameters()))


def test_path_length_on_an_empty_batch_raises() -> None:
    """Before: torch's reshape error."""
    w = as_points(torch.zeros(0, 3))
    with pytest.raises(GradientError, match="empty batch"):
        path_length()(nn.Linear(3, 5)(w), w)


@pytest.mark.parametrize("build", [
    lambda x: interpolate(x, x), lambda x: perturb_dragan(x), lambda x: as_points(x)])
def test_integer_data_is_refused_with_the_conversion(build) -> None:
    """Before: '"check_uniform_bounds" not implemented for 'Long''."""
    with pytest.raises(GradientError,
                       match=r"floating-point batches, got torch.int64.*\.float\(\)"):
        build(torch.zeros(4, 3, dtype=torch.long))


def test_regularized_backward_names_a_penalty_that_is_not_a_scalar() -> None:
    """Before: torch's 'grad can be implicitly created only for scalar outputs'."""
    net = nn.Linear(3, 2)
    y = net(torch.randn(5, 3)).sum()
    with pytest.raises(GradientError, match=r"penalties\[1\] has shape \(5, 3\).*square\(\)\.sum"):
        gradreg.regularized_backward(y, [y * 0, torch.ones(5, 3)], net.parameters())


def test_interpolate_with_alpha_on_the_real_side_is_the_usual_script_bit_for_bit() -> None:
    """``alpha * real + (1 - alpha) * fake``: caogang/wgan-gp, StudioGAN, mmagic."""
    real, fake = torch.randn(6, 2, 3, 3), torch.randn(6, 2, 3, 3)
    alpha = torch.rand(6, 1, 1, 1)
    points = interpolate(real, fake, alpha, alpha_on="real")
    assert torch.equal(points, alpha * real + (1 - alpha) * fake)
    assert points.requires_grad and points.is_leaf
    assert torch.equal(interpolate(real, fake, alpha.flatten(), alpha_on="real"), points)


def test_interpolate_default_side_and_draws_are_the_wgan_gp_papers() -> None:
    """``real + u (fake - real)``, one u ~ U[0, 1) per sample from the generator."""
    real, fake = torch.randn(5, 4), torch.randn(5, 4)
    drawn = interpolate(real, fake, generator=torch.Generator().manual_seed(3))
    u = torch.rand(5, 1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(drawn, torch.lerp(real, fake, u))
    assert torch.equal(interpolate(real, fake, u), drawn)
    assert torch.equal(interpolate(real, fake, 0.0), real)
    assert torch.equal(interpolate(real, fake, 1.0, alpha_on="real"), real)


@pytest.mark.parametrize(("alpha", "message"), [
    (1.5, r"in \[0, 1\]"), (torch.rand(3), r"shape \(3,\)"), (torch.rand(5, 4), r"shape \(5, 4\)")])
def test_interpolate_refuses_bad_coefficients(alpha, message: str) -> None:
    with pytest.raises(GradientError, match=message):
        interpolate(torch.randn(5, 4), torch.randn(5, 4), alpha)
    with pytest.raises(ValueError, match="alpha_on must be 'fake' or 'real'"):
        interpolate(torch.randn(5, 4), torch.randn(5, 4), alpha_on="both")


def test_presets_take_the_weight_positionally_and_say_their_signature() -> None:
    """wgan_gp(0.1) is wgan_gp(weight=0.1); a second positional argument or the weight twice is
    refused by Python's own argument binding."""
    assert wgan_gp(0.1).weight == wgan_gp(weight=0.1).weight == 0.1
    assert r1(2.0, every=4).config.every == 4 and r1().weight == 10.0
    assert str(inspect.signature(wgan_gp)) == "(weight: 'float' = 10.0, **options: 'Any') -> " \
                                              "'GradientPenalty'"
    assert wgan_gp.__name__ == "wgan_gp" and "Gulrajani" in wgan_gp.__doc__
    with pytest.raises(TypeError, match=r"wgan_gp\(\) takes from 0 to 1 positional arguments but "
                                        r"2 were given"):
        wgan_gp(0.1, 1.0)
    with pytest.raises(TypeError, match="r1\\(\\) got multiple values for argument 'weight'"):
        r1(1.0, weight=2.0)
    assert make_penalty("r1", weight=3.0).weight == 3.0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_function_defaults_to_the_weight_of_its_preset(name: str) -> None:
    function = getattr(presets, name)
    first = next(iter(inspect.signature(function).parameters.values()))
    # sam and asam: rho, the weight and the shift's size at once
    assert first.name == ("rho" if name in presets.RHO else "weight")
    assert first.default == PRESETS[name]["weight"]
    layers = {"layers": ["0"]} if name == "intermediate" else {}  # it has no default layers
    assert function(**layers).weight == PRESETS[name]["weight"]


def test_there_is_one_preset_function_per_preset_and_the_package_exports_each() -> None:
    functions = {name for name, value in vars(presets).items()
                 if inspect.isfunction(value) and value.__module__ == presets.__name__
                 and not name.startswith("_")} - {"make_penalty"}
    assert functions == set(PRESETS)
    assert functions <= set(gradreg.penalties.__all__)
    assert functions <= set(presets.__all__)


def test_a_recorded_cuda_value_reports_the_first_cause() -> None:
    """The asynchronous path carries [points, outputs, penalty, weighted] in one tensor; the
    first non-finite entry names the cause."""
    check = FiniteCheck()
    check._calls = 1
    check._recorded.append(_Recorded(1, torch.tensor([0.0, float("nan"), float("nan"), 1.0]),
                                     lambda: True, lambda: None))
    with pytest.raises(GradientError, match="outputs of call 1 contain NaN or Inf"):
        check.settle(wait=False)


def test_as_points_refuses_a_tensor_with_a_graph_naming_both_fixes() -> None:
    """as_points(embedding(ids)) detached the embeddings, so the embedding matrix silently got
    no task gradient; a tensor with a graph is refused, data and detached fakes are taken."""
    embedding = nn.Embedding(5, 3)
    with pytest.raises(GradientError, match=r"as_points got a tensor with a graph "
                                            r"\(grad_fn=EmbeddingBackward0\).*pass the tensor "
                                            r"itself.*as_points\(fakes\.detach\(\)\)"):
        as_points(embedding(torch.tensor([[0, 1]])))
    fakes = embedding(torch.tensor([[0, 1]]))
    points = as_points(fakes.detach())
    assert points.is_leaf and points.requires_grad and torch.equal(points, fakes)


def test_the_embeddings_as_points_keep_the_embedding_matrix_gradient() -> None:
    """Double backprop at an embedding layer's output, passed to the penalty as it is: the
    embedding matrix gets the task loss's gradient and the penalty's, equal to both written out
    by autograd (float64)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(6, 4).double()
    head = nn.Sequential(nn.Tanh(), nn.Flatten(), nn.Linear(8, 3)).double()
    ids, labels = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([0, 1, 2])

    def loss_terms() -> tuple[torch.Tensor, torch.Tensor]:
        embeds = embedding(ids)
        return F.cross_entropy(head(embeds), labels, reduction="none"), embeds

    losses, embeds = loss_terms()
    (losses.mean() + double_backprop(0.1)(losses, embeds)).backward()
    got = embedding.weight.grad.clone()
    losses, embeds = loss_terms()
    (g,) = torch.autograd.grad(losses.sum(), embeds, create_graph=True)
    reference = losses.mean() + 0.1 * g.square().sum((1, 2)).mean()
    (expected,) = torch.autograd.grad(reference, embedding.weight)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_points_of_different_batch_sizes_are_refused() -> None:
    a, c = as_points(torch.randn(8, 4)), as_points(torch.randn(1, 4))
    with pytest.raises(GradientError, match=r"batch sizes \[8, 1\]"):
        r1()((a + c).sum(1), [a, c])


def test_the_same_tensor_twice_is_refused() -> None:
    a = as_points(torch.randn(4, 2))
    with pytest.raises(GradientError, match="points 0 and 1 are the same tensor"):
        r1()(a.sum(1), [a, a])
    with pytest.raises(GradientError, match="same tensor"):
        make_penalty("param_grad_norm")(a.sum(), [a, a])


def test_complex_points_and_outputs_are_refused() -> None:
    z = torch.randn(3, 2, dtype=torch.complex128).requires_grad_()
    with pytest.raises(GradientError, match=r"point 0 is complex .*view_as_real"):
        r1()(z.abs().sum(1), z)
    x = as_points(torch.randn(3, 2, dtype=torch.float64))
    with pytest.raises(GradientError, match="the outputs are complex"):
        r1()(x.sum(1) * (1 + 1j), x)


def test_empty_batches_and_points_without_grad_are_refused() -> None:
    x = as_points(torch.randn(0, 2))
    with pytest.raises(GradientError, match="empty batch"):
        r1()(x.sum(1), x)
    y = torch.randn(3, 2)
    with pytest.raises(GradientError, match="does not require grad"):
        r1()(y.sum(1), y)
