"""A small convolutional network for 8x8 (or other small square) images."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from gradreg.models.layers import activation as make_activation


class CNN(nn.Sequential):
    """``(conv{i} 3x3 -> act{i}) per entry of channels -> pool 2x2 -> flatten -> out``.

    Layers are named ``conv1, act1, conv2, act2, ..., pool, flatten, out``; input ``[B, C, S, S]``
    with ``C = in_channels`` and ``S = image_size``; output ``[B, num_classes]`` logits. Average
    pooling keeps the input gradient dense (max pooling routes it through one pixel in four).
    """

    def __init__(
        self,
        num_classes: int = 10,
        *,
        in_channels: int = 1,
        image_size: int = 8,
        channels: Sequence[int] = (16, 32),
        activation: str = "relu",
    ) -> None:
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        width = in_channels
        for i, c in enumerate(channels, start=1):
            layers[f"conv{i}"] = nn.Conv2d(width, c, kernel_size=3, padding=1)
            layers[f"act{i}"] = make_activation(activation)
            width = c
        layers["pool"] = nn.AvgPool2d(2)
        layers["flatten"] = nn.Flatten()
        layers["out"] = nn.Linear(width * (image_size // 2) ** 2, num_classes)
        super().__init__(layers)
