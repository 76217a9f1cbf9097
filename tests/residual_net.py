"""A small ResNet-like network (convolutions, BatchNorm, residual additions, a chosen activation)
for tests that must see through every branch of a real model's backward graph."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

Activation = Callable[[], Callable[[Tensor], Tensor]]


class ResidualBlock(nn.Module):
    def __init__(self, channels: int, activation: Activation) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.act1, self.act2 = activation(), activation()

    def forward(self, x: Tensor) -> Tensor:
        h = self.act1(self.bn1(self.conv1(x)))
        return self.act2(x + self.bn2(self.conv2(h)))


class ResidualNet(nn.Module):
    """stem conv -> ``blocks`` residual blocks -> global average pool -> linear head."""

    def __init__(self, activation: Activation, channels: int = 4, blocks: int = 3,
                 classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(ResidualBlock(channels, activation) for _ in range(blocks)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))
