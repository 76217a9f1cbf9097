"""torchvision's ResNet-18 for small images (CIFAR-style stem), any number of classes.

He et al. 2016 built their CIFAR ResNets with a 3x3 stride-1 first convolution and no max pooling
(the ImageNet stem, a 7x7 stride-2 convolution and a 3x3 stride-2 pooling, would shrink a 32x32
image to 8x8 before the first block). :func:`resnet18` takes torchvision's ``resnet18`` with
random weights (nothing is downloaded) and swaps in that stem; the blocks keep torchvision's names
(``conv1, bn1, relu, layer1 ... layer4, avgpool, fc``), so a penalty on a hidden layer names one,
e.g. ``layers: [layer2]``.

Its BatchNorm layers make the samples of a training batch interact (batch statistics), so a
per-sample input gradient in training also carries the other samples' share through the batch
mean and variance; in evaluation (running statistics) the samples are independent again.
Needs the ``vision`` extra (torchvision).
"""

from __future__ import annotations

from torch import nn

from gradreg.models.torchvision_import import import_torchvision

torchvision_resnet18 = import_torchvision("model=resnet18").models.resnet18


def resnet18(num_classes: int = 10, *, in_channels: int = 3, small_images: bool = True
             ) -> nn.Module:
    """ResNet-18 logits ``[B, num_classes]`` for images ``[B, in_channels, S, S]``, random init.

    ``small_images=True``: the CIFAR stem (3x3 stride-1 ``conv1``, ``maxpool`` an identity), for
    S about 8 to 64; ``False``: torchvision's ImageNet stem (with ``in_channels`` input channels).
    """
    model = torchvision_resnet18(weights=None, num_classes=num_classes)
    stride, kernel = (1, 3) if small_images else (2, 7)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel, stride=stride, padding=kernel // 2,
                            bias=False)
    if small_images:
        model.maxpool = nn.Identity()
    return model
