"""The backbones: named layers (penalties address them), shapes, and the activation table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradreg.models import CNN, MLP


def test_mlp_layers_are_named_and_shaped() -> None:
    net = MLP(64, 10, hidden=(32, 16), activation="tanh")
    assert [name for name, _ in net.named_children()] == [
        "flatten", "fc1", "act1", "fc2", "act2", "out"]
    assert isinstance(net.act1, nn.Tanh)
    assert net(torch.zeros(5, 1, 8, 8)).shape == (5, 10)  # flattens images itself
    assert not any(isinstance(m, nn.BatchNorm1d) for m in net.modules())


def test_cnn_layers_are_named_and_shaped() -> None:
    net = CNN(10, channels=(4, 6))
    assert [name for name, _ in net.named_children()] == [
        "conv1", "act1", "conv2", "act2", "pool", "flatten", "out"]
    assert net.out.in_features == 6 * 4 * 4
    assert net(torch.zeros(3, 1, 8, 8)).shape == (3, 10)


def test_samples_do_not_interact() -> None:
    torch.manual_seed(0)
    net, x = CNN(10), torch.rand(4, 1, 8, 8)
    assert torch.allclose(net(x)[1:2], net(x[1:2]), atol=1e-6)


def test_unknown_activation_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"activation='gelu' is unknown; valid values: \['elu'"):
        MLP(2, 1, activation="gelu")
