"""The TF32 emulation rounds float32 operands of convolutions and matmuls to 10 mantissa bits."""

import torch

from tests.tf32 import EmulatedTF32, round_to_tf32


def test_rounding_keeps_ten_mantissa_bits_ties_away_from_zero() -> None:
    x = torch.tensor([1 + 2.0**-10, 1 + 2.0**-11, 1 + 2.0**-12, -(1 + 3 * 2.0**-12), 3.0,
                      float("inf")])
    expected = torch.tensor([1 + 2.0**-10, 1 + 2.0**-10, 1.0, -(1 + 2.0**-10), 3.0,
                             float("inf")])
    assert torch.equal(round_to_tf32(x), expected)
    assert round_to_tf32(x.double()).dtype == torch.float64  # other dtypes pass through


def test_matmuls_and_convolutions_see_rounded_operands_elementwise_ops_do_not() -> None:
    a = torch.tensor([[1 + 2.0**-12]])
    with EmulatedTF32():
        assert (a @ torch.ones(1, 1)).item() == 1.0
        assert torch.nn.functional.conv1d(a.view(1, 1, 1), torch.ones(1, 1, 1)).item() == 1.0
        assert (a * 1.0).item() == 1 + 2.0**-12
