"""Networks: an MLP (classifier backbone, 2D generator and critic) and a small CNN."""

from gradreg.models.cnn import CNN
from gradreg.models.layers import ACTIVATIONS
from gradreg.models.mlp import MLP

__all__ = ["ACTIVATIONS", "CNN", "MLP"]
