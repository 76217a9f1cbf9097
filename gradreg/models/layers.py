"""Activation functions by name, so that configs can pick them."""

from __future__ import annotations

from torch import nn

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "leaky_relu": nn.LeakyReLU,
    "elu": nn.ELU,
    "softplus": nn.Softplus,
    "tanh": nn.Tanh,
}


def activation(name: str) -> nn.Module:
    """A fresh activation module called ``name`` (one of :data:`ACTIVATIONS`)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is unknown; valid values: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()
