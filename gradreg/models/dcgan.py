"""DCGAN-style generator and critic for square images of 16, 32 or 64 pixels (Radford et al. 2016).

For images ``[C, S, S]`` with ``S = 4 * 2**n`` (``n = 2, 3, 4``) and base width ``w``:

* generator ``G: z [B, latent_dim] -> [B, C, S, S]``: ``fc`` to ``[w 2^(n-1), 4, 4]`` -> BatchNorm
  -> ReLU, then ``n - 1`` blocks ``up{i}`` (4x4 transposed convolution, stride 2, channels halved)
  -> BatchNorm -> ReLU, and ``out``: a 4x4 transposed convolution, stride 2, to ``C`` channels ->
  sigmoid, so samples lie in [0, 1] like the data (pixel / 255, or the digits / 16);
* critic ``D: [B, C, S, S] -> [B, 1]``: ``n`` blocks ``down{i}`` (4x4 convolution, stride 2,
  channels ``w, 2w, 4w ...``) -> LeakyReLU(0.2), then ``flatten`` and ``out`` (linear to one
  score). No normalization layer: a gradient penalty needs per-sample critic gradients, which
  batch statistics would mix (Gulrajani et al. 2017 drop BatchNorm from the critic for this).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from gradreg.models.layers import activation as make_activation


def _blocks(shape: Sequence[int]) -> tuple[int, int]:
    """``(C, n)`` for an image shape ``[C, S, S]`` with ``S = 4 * 2**n``, 16 <= S <= 64."""
    channels, *size = (int(s) for s in shape)
    if len(size) != 2 or size[0] != size[1] or size[0] not in (16, 32, 64):
        raise ValueError(f"image shape {list(shape)} must be [C, S, S] with S in 16, 32, 64")
    return channels, size[0].bit_length() - 3


class DCGANGenerator(nn.Sequential):
    """Latents ``[B, latent_dim]`` to images ``[B, *shape]`` in [0, 1] (module docstring)."""

    def __init__(self, latent_dim: int, shape: Sequence[int], width: int = 32) -> None:
        channels, n = _blocks(shape)
        top = width * 2 ** (n - 1)
        layers: OrderedDict[str, nn.Module] = OrderedDict(
            fc=nn.Linear(latent_dim, top * 16, bias=False),
            reshape=nn.Unflatten(1, (top, 4, 4)),
            bn0=nn.BatchNorm2d(top),
            act0=nn.ReLU(),
        )
        for i in range(1, n):
            layers[f"up{i}"] = nn.ConvTranspose2d(top, top // 2, 4, stride=2, padding=1,
                                                  bias=False)
            layers[f"bn{i}"] = nn.BatchNorm2d(top // 2)
            layers[f"act{i}"] = nn.ReLU()
            top //= 2
        layers["out"] = nn.ConvTranspose2d(top, channels, 4, stride=2, padding=1)
        layers["sigmoid"] = nn.Sigmoid()
        super().__init__(layers)


class DCGANCritic(nn.Sequential):
    """Images ``[B, *shape]`` to scores ``[B, 1]``, no normalization (module docstring).

    ``activation``: ``None`` for DCGAN's LeakyReLU(0.2), or a name of
    :data:`gradreg.models.ACTIVATIONS` (a smooth one, e.g. ``"tanh"``, where a method needs a
    smooth critic: finite differences refuse piecewise-linear ones).
    """

    def __init__(self, shape: Sequence[int], width: int = 32, *,
                 activation: str | None = None) -> None:
        channels, n = _blocks(shape)
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for i in range(1, n + 1):
            layers[f"down{i}"] = nn.Conv2d(channels, width, 4, stride=2, padding=1)
            layers[f"act{i}"] = (nn.LeakyReLU(0.2) if activation is None
                                 else make_activation(activation))
            channels, width = width, width * 2
        layers["flatten"] = nn.Flatten()
        layers["out"] = nn.Linear(channels * 16, 1)
        super().__init__(layers)
