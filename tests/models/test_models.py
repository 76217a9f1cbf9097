"""The backbones: named layers (penalties address them), shapes, and the activation table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradreg.models import CNN, MLP, DCGANCritic, DCGANGenerator


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


@pytest.mark.parametrize(("size", "blocks"), [(16, 2), (32, 3), (64, 4)])
def test_dcgan_shapes_layers_and_range(size: int, blocks: int) -> None:
    """S = 4 * 2**n: the generator doubles 4x4 n times, the critic halves S n times to 4x4."""
    torch.manual_seed(0)
    generator, critic = DCGANGenerator(8, (3, size, size), width=4), DCGANCritic((3, size, size),
                                                                                  width=4)
    images = generator(torch.randn(5, 8)).detach()
    assert images.shape == (5, 3, size, size)
    assert float(images.min()) > 0 and float(images.max()) < 1  # sigmoid: the data's range
    assert critic(images).shape == (5, 1)
    assert [name for name, _ in critic.named_children()][-2:] == ["flatten", "out"]
    assert sum(name.startswith("down") for name, _ in critic.named_children()) == blocks
    assert sum(name.startswith("up") for name, _ in generator.named_children()) == blocks - 1
    assert generator.fc.out_features == 4 * 2 ** (blocks - 1) * 16
    assert critic.out.in_features == 4 * 2 ** (blocks - 1) * 16
    assert not any(isinstance(m, nn.BatchNorm2d) for m in critic.modules())


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 48, 48), (3, 32, 16), (128,)])
def test_dcgan_refuses_other_sizes(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"must be \[C, S, S\] with S in 16, 32, 64"):
        DCGANCritic(shape)


def test_resnet18_has_the_cifar_stem_and_any_class_count() -> None:
    pytest.importorskip("torchvision")
    from gradreg.models.resnet import resnet18

    net = resnet18(3, in_channels=1)
    assert (net.conv1.kernel_size, net.conv1.stride, net.conv1.in_channels) == ((3, 3), (1, 1), 1)
    assert isinstance(net.maxpool, nn.Identity) and net.fc.out_features == 3
    assert net(torch.zeros(2, 1, 16, 16)).shape == (2, 3)
    names = [name for name, _ in net.named_children()]
    assert names == ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4",
                     "avgpool", "fc"]
    imagenet = resnet18(10, small_images=False)
    assert (imagenet.conv1.kernel_size, imagenet.conv1.stride) == ((7, 7), (2, 2))
    assert isinstance(imagenet.maxpool, nn.MaxPool2d)
