"""Small vision transformers built from a config: a ViT critic and a transformer classifier.

Both are ``patches -> embed -> (+ position) -> nn.TransformerEncoder (pre-norm) -> LayerNorm ->
mean over tokens -> out``. An image ``[B, C, S, S]`` is cut into ``(S / patch)^2`` patches of
``C * patch^2`` pixels, each a token; the submodule ``embed`` (a linear map of the patch) is the
token embedding that ``penalty=intermediate`` names (``layers=[embed]``). The attention is
``F.scaled_dot_product_attention`` (``nn.MultiheadAttention``): exact penalties run through it
by :func:`gradreg.differentiable_attention`, which the penalties and the Lightning modules enter
where they need it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["TransformerClassifier", "ViTCritic", "VisionTransformer"]


class VisionTransformer(nn.Module):
    """``[B, C, S, S] -> [B, outputs]`` (module docstring).

    Args:
        outputs: the size of the output (classes, or 1 for a critic).
        image_shape: ``[C, S, S]``; ``S`` a multiple of ``patch``.
        patch: the side of a square patch, in pixels.
        dim: the token width; ``heads`` must divide it.
        depth: the number of encoder layers.
        heads: attention heads per layer.
        mlp_ratio: the hidden width of each layer's MLP, in units of ``dim``.
        dropout: dropout of the attention weights and the MLP (0 in a critic: a penalty's
            forward should see the same function as the loss's).
    """

    def __init__(self, outputs: int, *, image_shape: Sequence[int] = (1, 8, 8), patch: int = 2,
                 dim: int = 32, depth: int = 2, heads: int = 4, mlp_ratio: float = 2.0,
                 dropout: float = 0.0) -> None:
        super().__init__()
        channels, height, width = image_shape
        if height != width or height % patch:
            raise ValueError(f"image_shape must be [C, S, S] with S a multiple of patch={patch}, "
                             f"got {list(image_shape)}")
        if dim % heads:
            raise ValueError(f"heads={heads} must divide dim={dim}")
        self.patch = patch
        self.embed = nn.Linear(channels * patch * patch, dim)
        self.position = nn.Parameter(torch.zeros(1, (height // patch) ** 2, dim))
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, round(mlp_ratio * dim), dropout=dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, outputs)

    def patches(self, x: Tensor) -> Tensor:
        """``[B, C, S, S] -> [B, (S/p)^2, C p^2]``, row-major over the patch grid."""
        b, c, _, _ = x.shape
        p = self.patch
        tiles = x.unfold(2, p, p).unfold(3, p, p)  # [B, C, S/p, S/p, p, p]
        return tiles.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.embed(self.patches(x)) + self.position
        return self.out(self.norm(self.encoder(tokens)).mean(dim=1))


class ViTCritic(VisionTransformer):
    """A critic ``[B, C, S, S] -> [B, 1]`` (:class:`VisionTransformer` with one output), taking
    :class:`~gradreg.models.DCGANCritic`'s ``shape`` (``[C, S, S]``) and ``width`` (the token
    width ``dim``), so a GAN config swaps one for the other by its ``_target_``."""

    def __init__(self, shape: Sequence[int] = (1, 16, 16), width: int = 32, *, patch: int = 4,
                 depth: int = 2, heads: int = 4, mlp_ratio: float = 2.0) -> None:
        super().__init__(1, image_shape=shape, patch=patch, dim=width, depth=depth,
                         heads=heads, mlp_ratio=mlp_ratio)


class TransformerClassifier(VisionTransformer):
    """Logits ``[B, num_classes]`` of an image (:class:`VisionTransformer`)."""

    def __init__(self, num_classes: int = 10, *, image_shape: Sequence[int] = (1, 8, 8),
                 patch: int = 2, dim: int = 32, depth: int = 2, heads: int = 4,
                 mlp_ratio: float = 2.0, dropout: float = 0.0) -> None:
        super().__init__(num_classes, image_shape=image_shape, patch=patch, dim=dim,
                         depth=depth, heads=heads, mlp_ratio=mlp_ratio, dropout=dropout)
