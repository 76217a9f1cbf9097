"""A plain multilayer perceptron with named layers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from gradreg.models.layers import activation as make_activation


class MLP(nn.Sequential):
    """``flatten -> (fc{i} -> act{i}) for each hidden width -> out``, no normalization layers.

    The layers are named ``fc1, act1, fc2, act2, ..., out`` so penalties on hidden activations
    can address them (``layers: [act1]``). Without BatchNorm every sample's output depends on that
    sample only, which makes per-sample input gradients (and the WGAN-GP critic) well defined.
    Serves as classifier backbone, 2D generator (latent -> 2) and 2D critic (2 -> 1).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        hidden: Sequence[int] = (128, 128),
        activation: str = "relu",
    ) -> None:
        layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
        width = in_features
        for i, h in enumerate(hidden, start=1):
            layers[f"fc{i}"] = nn.Linear(width, h)
            layers[f"act{i}"] = make_activation(activation)
            width = h
        layers["out"] = nn.Linear(width, out_features)
        super().__init__(layers)
