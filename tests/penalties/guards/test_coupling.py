"""Models whose samples interact, found by what the model does (a probe: one sample's input moves
other samples' outputs), not by a list of layer types: the penalties that run the model on part of
the batch or at points moved per sample refuse them; the exact double backward of the batch's own
forward is right for them."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import gradreg
from gradreg import GradientError
from gradreg.penalties import GeneratorState, make_penalty
from gradreg.penalties.guards.coupling import check_independent_samples, probe_independent_samples
from gradreg.penalties.methods.chunks import subsample

F64 = torch.float64


class MinibatchStddev(nn.Module):
    """StyleGAN2's minibatch standard deviation (``MinibatchStdLayer`` with one channel), for
    feature vectors: samples are split into groups ``i, i + n, i + 2n, ...`` of ``group_size``;
    each group's per-feature standard deviation, averaged over the features, is appended to its
    samples as one more feature."""

    def __init__(self, group_size: int = 4) -> None:
        super().__init__()
        self.group_size = group_size

    def forward(self, x: Tensor) -> Tensor:
        n, c = x.shape
        g = min(self.group_size, n)
        y = x.reshape(g, -1, c)                    # [G, n/G, C]
        y = y - y.mean(dim=0)
        y = (y.square().mean(dim=0) + 1e-8).sqrt()  # [n/G, C]
        y = y.mean(dim=1).reshape(-1, 1)           # [n/G, 1]
        return torch.cat([x, y.repeat(g, 1)], dim=1)


class BatchCentering(nn.Module):
    """Subtracts the batch mean: samples coupled without any normalization layer."""

    def forward(self, x: Tensor) -> Tensor:
        return x - x.mean(dim=0)


def critic(layer: nn.Module, width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    extra = 1 if isinstance(layer, MinibatchStddev) else 0
    return nn.Sequential(nn.Linear(3, width), nn.Tanh(), layer, nn.Linear(width + extra, 1),
                         nn.Flatten(0)).to(F64)


def reals(n: int = 8) -> Tensor:
    return torch.randn(n, 3, dtype=F64, generator=torch.Generator().manual_seed(1))


COUPLED = {
    "minibatch_stddev": MinibatchStddev,
    "batch_centering": BatchCentering,
    "batchnorm": lambda: nn.BatchNorm1d(8),
    "gradreg_batchnorm": lambda: gradreg.convert_batchnorm(nn.BatchNorm1d(8)),
}

REFUSING = {
    "chunks": lambda: make_penalty("r1", chunks=2),
    "subsample": lambda: make_penalty("r1", subsample=0.5),
    "approx_r1": lambda: make_penalty("approx_r1"),
    "finite_difference": lambda: make_penalty("r1", method="finite_difference"),
    "spectral": lambda: make_penalty("spectral"),
}


def r1_by_differences(model: nn.Module, x: Tensor, h: float = 1e-5) -> Tensor:
    """R1 (λ = 10, gain 1/2) of the batch's forward by central differences of S(X) = Σᵢ D(X)ᵢ
    in every coordinate of X: mean_i ‖∂S/∂xᵢ‖², no autograd."""
    grad = torch.zeros_like(x)
    with torch.no_grad():
        for index in range(x.numel()):
            step = torch.zeros_like(x).view(-1)
            step[index] = h
            step = step.view_as(x)
            grad.view(-1)[index] = (model(x + step).sum() - model(x - step).sum()) / (2 * h)
    return 10.0 * 0.5 * grad.square().sum(1).mean()


def test_minibatch_stddev_exact_r1_is_that_of_the_batch_and_chunks_refuse_it() -> None:
    """The exact double backward of the batch's own forward equals R1 by central differences of
    the batch's sum (0.444852 on this critic, cross-sample terms included). Two micro-batches
    form groups of their own: the mean of their R1s is another penalty (0.444774), which
    chunks=2 returned; refused now."""
    model, x = critic(MinibatchStddev()), reals()
    expected = r1_by_differences(model, x)
    exact = make_penalty("r1")(model(x.requires_grad_()), x)
    torch.testing.assert_close(exact.detach(), expected, rtol=1e-8, atol=0)
    halves = [h.detach().requires_grad_() for h in x.split(4)]
    per_half = sum(make_penalty("r1")(model(h), h) for h in halves) / 2
    assert abs(float(per_half.detach()) / float(expected) - 1) > 1e-4
    with pytest.raises(GradientError, match="samples are coupled"):
        make_penalty("r1", chunks=2)(model, x)


@pytest.mark.parametrize("method", REFUSING)
@pytest.mark.parametrize("layer", COUPLED)
def test_penalties_on_part_of_the_batch_or_moved_points_refuse_coupled_samples(
        method: str, layer: str) -> None:
    """Every penalty that runs the model on part of the batch or at points moved per sample
    refuses each kind of coupling, with the fix; BatchNorm is named where it is the cause."""
    model, x = critic(COUPLED[layer]()).train(), reals().requires_grad_()
    message = ("BatchNorm in training mode" if "batchnorm" in layer
               else "samples are coupled: the outputs of the others depend on sample 0")
    if method == "spectral" and "batchnorm" in layer:  # torch.func refuses the in-place update
        message = "kind='spectral' runs the model under torch.func.*BatchNorm in training mode"
    with pytest.raises(GradientError, match=message):
        REFUSING[method]()(model, x)


@pytest.mark.parametrize("method", ["finite_difference", "double_backward"])
def test_hessian_refuses_a_generator_with_coupled_samples(method: str) -> None:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), MinibatchStddev(), nn.Linear(9, 3))
    z = torch.randn(8, 2, dtype=F64)
    with pytest.raises(GradientError, match="kind='hessian' .*samples are coupled"):
        make_penalty("hessian", method=method)(generator.to(F64), z)


@pytest.mark.parametrize("layer", [nn.LayerNorm(8), nn.Dropout(0.2), nn.Softmax(dim=1),
                                   nn.BatchNorm1d(8).eval()],
                         ids=["layernorm", "dropout", "softmax", "batchnorm_eval"])
@pytest.mark.parametrize("method", REFUSING)
def test_per_sample_layers_are_not_mistaken_for_coupling(method: str, layer: nn.Module) -> None:
    """Layers that act on each sample alone pass the probe (its zero rows are exact)."""
    model, x = critic(layer), reals().requires_grad_()
    model.train(not isinstance(layer, nn.BatchNorm1d))
    if method == "chunks" and isinstance(layer, nn.Dropout):
        layer.eval()  # chunks refuse models that draw (tests/penalties/state/test_random_layers.py)
    value = REFUSING[method]()(model, x)
    assert torch.isfinite(value) and value > 0


def test_the_probe_looks_at_two_samples_where_chunks_or_a_subsample_would_leave_one() -> None:
    """Chunks of one sample (or a subsample of one) cannot show a coupling: the first call splits
    into micro-batches of at least two and a subsample keeps at least two."""
    model, x = critic(MinibatchStddev()), reals().requires_grad_()
    with pytest.raises(GradientError, match="samples are coupled"):
        make_penalty("r1", chunks=8)(model, x)
    with pytest.raises(GradientError, match="samples are coupled"):
        make_penalty("r1", subsample=0.1)(model, x)
    assert [len(t) for t in subsample((x, x[:, 0]), 0.1)] == [2, 2]
    assert len(subsample((x[:1],), 0.1)[0]) == 1


def test_probe_leaves_the_generators_and_running_statistics_unchanged() -> None:
    """The probe's own forward runs from the current random state, which it restores, and a
    model that passes it (no BatchNorm in training mode) has no statistics to update."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.BatchNorm1d(8), nn.Dropout(0.3),
                          nn.Linear(8, 1), nn.Flatten(0)).to(F64).train()
    model[2].eval()
    before = [b.clone() for b in model.buffers()]
    state = GeneratorState.capture()
    probe_independent_samples(model, (reals(),), "the test")
    assert not state.moved()
    for mine, then in zip(model.buffers(), before, strict=True):
        assert torch.equal(mine, then)


def test_a_refused_probe_leaves_batchnorms_running_statistics_as_they_were() -> None:
    """The Hessian penalty's probe runs a forward of its own: refusing BatchNorm in training
    mode, it restores the running statistics and the counter that forward updated."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.Tanh(),
                              nn.Linear(8, 3)).to(F64)
    before = {k: v.clone() for k, v in generator.state_dict().items()}
    with pytest.raises(GradientError, match="kind='hessian' .*BatchNorm in training mode"):
        make_penalty("hessian")(generator, torch.randn(8, 2, dtype=F64))
    for key, value in generator.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_check_independent_samples_reads_exact_zeros() -> None:
    """One backward of samples 1.. to the points: zero rows of sample 0 for a per-sample map,
    a nonzero one as soon as sample 0 reaches another sample's output."""
    x = reals(4).requires_grad_()
    check_independent_samples(torch.tanh(x) * 3, (x,), "the test")
    check_independent_samples(x[:1].sum(1), (x[:1],), "a batch of one")  # nothing to probe
    coupled = torch.tanh(x) + 1e-12 * x[0].sum()
    with pytest.raises(GradientError, match="the test runs the model .* samples are coupled"):
        check_independent_samples(coupled, (x,), "the test")
