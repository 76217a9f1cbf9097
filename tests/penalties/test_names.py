"""One name per concept: ``step`` for a step size, ``count`` for a number of random directions,
``"double_backward"`` for the exact method everywhere; the names of earlier releases are refused
with the new one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradreg.penalties import GradientPenalty, as_points, make_penalty, presets
from gradreg.penalties.kinds.hessian import hessian_penalty
from gradreg.penalties.methods.perturbation import perturbation_sq_norms

F64 = torch.float64
RENAMED = [("fd_eps", "step", "r1", {"method": "finite_difference"}, 0.01),
           ("sigma", "step", "approx_r1", {}, 0.05),
           ("epsilon", "step", "hessian", {}, 0.2),
           ("num_projections", "count", "jacobian", {}, 2),
           ("probes", "count", "approx_r1", {}, 3),
           ("k", "count", "hessian", {}, 3)]


@pytest.mark.parametrize(("old", "new", "preset", "options", "value"), RENAMED)
def test_an_old_option_name_is_refused_with_the_new_one(old: str, new: str, preset: str,
                                                        options: dict, value: float) -> None:
    message = f"option '{old}' was renamed '{new}': pass {new}={value!r}"
    with pytest.raises(TypeError, match=message):
        make_penalty(preset, **options, **{old: value})
    with pytest.raises(TypeError, match=message):
        getattr(presets, preset)(1.0, **options, **{old: value})
    with pytest.raises(TypeError, match=message):
        GradientPenalty(**{**presets.PRESETS[preset], **options, old: value})
    penalty = make_penalty(preset, **options, **{new: value})  # the new name takes it
    assert getattr(penalty.config, new) == value
    with pytest.raises(AttributeError,
                       match=f"'{old}' was renamed '{new}': read penalty.config.{new}"):
        getattr(penalty, old)


def _generator() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()


def test_left_out_step_and_count_are_the_estimates_defaults() -> None:
    """hessian(): count 2, step 0.1 (the authors' k and epsilon); approx_r1(): one probe at
    step 0.01 (APT's sigma); each equal to the function called with those values and the same
    random draws."""
    g, z = _generator(), torch.randn(6, 3, dtype=F64)
    torch.manual_seed(3)
    got = presets.hessian(1.0)(g, as_points(z))
    torch.manual_seed(3)
    expected = hessian_penalty(g, z, count=2, step=0.1, reduction="max")
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    critic = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)).double()
    x = torch.randn(5, 3, dtype=F64)
    torch.manual_seed(4)
    got = presets.approx_r1(2.0)(critic, as_points(x))
    torch.manual_seed(4)
    expected = perturbation_sq_norms(critic, x, step=0.01, count=1).mean()
    # a linear critic: the estimate is exactly (eps . w)^2, the same draws
    torch.testing.assert_close(got, 2.0 * 0.5 * expected, rtol=1e-12, atol=0)


def test_the_exact_hessian_penalty_is_double_backward_at_every_level() -> None:
    """method='double_backward' names the exact form of the function and of the preset alike;
    on a quadratic generator G(z) = (z . a)(z . b) the second difference is exact too, so both
    methods give one value."""
    a, b = torch.tensor([1.0, 2.0, -1.0], dtype=F64), torch.tensor([0.5, -1.0, 3.0], dtype=F64)

    def quadratic(z: torch.Tensor) -> torch.Tensor:
        return ((z @ a) * (z @ b)).unsqueeze(1)

    z = torch.randn(4, 3, dtype=F64)
    directions = torch.tensor([1.0, -1.0], dtype=F64)[torch.randint(0, 2, (2, 4, 3))]
    exact = hessian_penalty(quadratic, z, directions=directions, method="double_backward")
    fd = hessian_penalty(quadratic, z, directions=directions, method="finite_difference")
    # v^T H v = 2 (v . a)(v . b) per sample; the unbiased variance over the 2 directions
    second = 2 * (directions @ a) * (directions @ b)  # [2, 4]
    expected = second.var(dim=0, correction=1).amax()
    torch.testing.assert_close(exact, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(fd, expected, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="method 'finite_difference' or 'double_backward', got "
                                         "method='exact'"):
        hessian_penalty(quadratic, z, method="exact")
