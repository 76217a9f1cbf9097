"""The benchmark's cases: a model of :mod:`gradreg.models`, its task loss and its penalty's points.

Kinds: ``mlp`` (784-W-W-10) and ``digits_mlp`` (64-W-W-10) classifiers, ``cnn`` (two 3x3
convolutions of width W on 1x8x8 images) and ``bn_cnn`` (a small BatchNorm ResNet), all with double
backprop on the per-sample cross-entropy (forward shared with the task); ``resnet18``
(torchvision's, CIFAR stem, 3x32x32); ``critic_wgan_gp`` / ``critic_r1`` (a 3-block DCGAN critic
of 3x32x32 images, 3x16x16 in the quick grid) and ``dcgan_wgan_gp`` / ``dcgan_r1`` (the 4-block
DCGAN critic of 3x64x64 images), with a Wasserstein loss + WGAN-GP at the interpolates (own
forward) or a non-saturating loss + R1 at the reals (forward shared with the loss);
``generator_hessian``: a tanh MLP generator of 16x16 images (16 latents, two hidden layers of
width W) with the Hessian penalty at its latents (forward shared with a stand-in task loss, the
mean squared pixel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradreg import convert_batchnorm
from gradreg.models import CNN, MLP, DCGANCritic
from gradreg.models.layers import activation as make_activation
from gradreg.penalties import as_points, interpolate

#: Inputs of the MLP cases: MNIST-sized, and the 8x8 digits of the app (the targets' reference).
MLP_INPUTS = {"mlp": 784, "digits_mlp": 64}
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class BasicBlock(nn.Module):
    """ResNet's basic block: conv-BN-act-conv-BN plus the identity, then the activation."""

    def __init__(self, width: int, activation: str) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), make_activation(activation),
                                  nn.Conv2d(width, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width))
        self.act = make_activation(activation)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(x + self.body(x))


def bn_resnet(width: int, activation: str) -> nn.Module:
    """A small ResNet of 3-channel images: a 3x3 stem, one basic block, global average pooling, a
    linear head; BatchNorm after every convolution."""
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                         make_activation(activation), BasicBlock(width, activation),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def resnet18_cifar() -> nn.Module:
    """torchvision's ResNet-18 with the CIFAR stem (``gradreg.models.resnet``)."""
    try:
        from gradreg.models.resnet import resnet18
    except ImportError as err:
        raise SystemExit(f"error: case 'resnet18' needs torchvision ({err}); leave it out with "
                         "--cases") from err
    return resnet18(10)


#: Image classifiers with double backprop: (model builder, input shape), by kind.
IMAGE_CLASSIFIERS: dict[str, tuple[Callable[[int, str], nn.Module],
                                   Callable[[int], tuple[int, ...]]]] = {
    "cnn": (lambda width, act: CNN(10, channels=(width, width), activation=act),
            lambda width: (1, 8, 8)),
    "bn_cnn": (bn_resnet, lambda width: (3, 32, 32) if width >= 16 else (3, 8, 8)),
    "resnet18": (lambda width, act: resnet18_cifar(), lambda width: (3, 32, 32)),
}


class PerSampleLoss(nn.Module):
    """Per-sample cross-entropy of a classifier: a module; the labels are
    the penalty's ``fn_args`` (split with the points by ``subsample`` and ``chunks``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self.model(x), labels, reduction="none")


@dataclass
class Case:
    """One benchmark configuration: the forward passes every method's step is built from."""

    name: str
    model: nn.Module
    penalty: str  # a gradreg preset
    batch: int
    width: int
    task: Callable[[], Tensor]  # the plain step's loss
    points: Callable[[], Tensor]  # fresh evaluation points (leaves requiring grad)
    fn: nn.Module  # per-sample outputs at given points: fn(points, *fn_args)
    fn_args: tuple[Tensor, ...]  # the per-sample labels of a classifier's loss
    shared: bool  # whether the task loss's forward is at the points (R1, double backprop)
    task_with: Callable[[Tensor], tuple[Tensor, Tensor]]  # (task loss, outputs at the points)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def has_batchnorm(self) -> bool:
        return any(isinstance(m, BATCHNORMS) for m in self.model.modules())


def make_case(kind: str, batch: int, width: int, activation: str, dtype: torch.dtype,
              device: torch.device, gradreg_batchnorm: bool = False) -> Case:
    """The case ``kind``; with ``gradreg_batchnorm`` its model's BatchNorm layers are gradreg's
    (:func:`gradreg.convert_batchnorm`), everything else identical (same seed)."""
    torch.manual_seed(0)
    convert = convert_batchnorm if gradreg_batchnorm else (lambda module: module)
    if kind in MLP_INPUTS or kind in IMAGE_CLASSIFIERS:
        if kind in MLP_INPUTS:
            shape = (MLP_INPUTS[kind],)
            model = MLP(MLP_INPUTS[kind], 10, hidden=(width, width), activation=activation)
        else:
            build, shape_of = IMAGE_CLASSIFIERS[kind]
            shape, model = shape_of(width), build(width, activation)
        return classifier_case(kind, convert(model).to(device, dtype), batch, width, shape)
    if kind == "generator_hessian":
        return generator_case(MLP(16, 256, hidden=(width, width), activation=activation)
                              .to(device, dtype), batch, width)
    if kind.startswith("dcgan"):
        family, size, critic = "dcgan", 64, DCGANCritic((3, 64, 64), width)
    else:  # the quick grid's tiny critics see 16x16 images
        family, size = "critic", 32 if width >= 16 else 16
        critic = DCGANCritic((3, size, size), width, activation=activation)
    critic = convert(critic).to(device, dtype)
    real = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    fake = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    penalty = "r1" if kind.endswith("_r1") else "wgan_gp"
    return critic_case(f"{family}/{penalty}", critic, real, fake, width)


def classifier_case(kind: str, model: nn.Module, batch: int, width: int,
                    shape: tuple[int, ...]) -> Case:
    """Double backprop on the per-sample cross-entropy of random inputs and labels."""
    parameter = next(model.parameters())
    x = torch.randn(batch, *shape, device=parameter.device, dtype=parameter.dtype)
    y = torch.randint(0, 10, (batch,), device=parameter.device)
    fn = PerSampleLoss(model)

    def task_with(p: Tensor) -> tuple[Tensor, Tensor]:
        losses = fn(p, y)
        return losses.mean(), losses

    return Case(f"{kind}/double_backprop", model, "double_backprop", batch, width,
                lambda: fn(x, y).mean(), lambda: as_points(x), fn, (y,), True, task_with)


def generator_case(generator: nn.Module, batch: int, width: int) -> Case:
    """The Hessian penalty of a generator at its latents; the task is the mean squared pixel of
    its samples (a stand-in for the adversarial term: one forward and backward of G)."""
    parameter = next(generator.parameters())
    z = torch.randn(batch, 16, device=parameter.device, dtype=parameter.dtype)

    def task_with(p: Tensor) -> tuple[Tensor, Tensor]:
        images = generator(p)
        return images.square().mean(), images

    return Case("generator/hessian", generator, "hessian", batch, width,
                lambda: generator(z).square().mean(), lambda: as_points(z), generator, (), True,
                task_with)


def critic_case(name: str, critic: nn.Module, real: Tensor, fake: Tensor, width: int) -> Case:
    """R1 with the non-saturating loss (StyleGAN2: the gradient of the loss's own real scores), or
    WGAN-GP with the Wasserstein loss (its own forward at the interpolates)."""
    batch = real.shape[0]
    if name.endswith("/r1"):
        def logistic(d_real: Tensor) -> Tensor:  # the non-saturating critic loss
            return F.softplus(critic(fake)).mean() + F.softplus(-d_real).mean()

        def scores_at_reals(p: Tensor) -> tuple[Tensor, Tensor]:
            d_real = critic(p)
            return logistic(d_real), d_real

        return Case(name, critic, "r1", batch, width, lambda: logistic(critic(real)),
                    lambda: as_points(real), critic, (), True, scores_at_reals)

    def wasserstein() -> Tensor:
        return critic(fake).mean() - critic(real).mean()

    def scores_at_interpolates(p: Tensor) -> tuple[Tensor, Tensor]:
        return wasserstein(), critic(p)

    return Case(name, critic, "wgan_gp", batch, width, wasserstein,
                lambda: interpolate(real, fake), critic, (), False, scores_at_interpolates)


def grid(quick: bool, suite: str = "cpu") -> list[tuple[str, int, int]]:
    """(kind, batch, width) of each case. The ``gpu`` suite: ResNet-18 (CIFAR, batch 128), the
    small BatchNorm ResNet, the DCGAN critic at 64x64 (batch 64, WGAN-GP and R1) and the MLP
    784-1024-1024-10 at batch 1024; ``quick`` shrinks either."""
    if suite == "gpu":
        if quick:
            return [("bn_cnn", 8, 4), ("dcgan_wgan_gp", 4, 4), ("dcgan_r1", 4, 4), ("mlp", 32, 32)]
        return [("resnet18", 128, 64), ("bn_cnn", 128, 64), ("dcgan_wgan_gp", 64, 64),
                ("dcgan_r1", 64, 64), ("mlp", 1024, 1024)]
    if quick:
        return [("mlp", 32, 32), ("mlp", 128, 32), ("cnn", 8, 4), ("critic_wgan_gp", 4, 4),
                ("critic_r1", 4, 4)]
    return [("mlp", 64, 256), ("mlp", 256, 256), ("mlp", 1024, 256), ("mlp", 4096, 256),
            ("mlp", 256, 64), ("mlp", 256, 1024), ("digits_mlp", 256, 256),
            ("cnn", 32, 16), ("cnn", 128, 16), ("cnn", 128, 32), ("bn_cnn", 64, 16),
            ("critic_wgan_gp", 16, 32), ("critic_wgan_gp", 64, 32),
            ("critic_r1", 16, 32), ("critic_r1", 64, 32), ("generator_hessian", 64, 64)]
