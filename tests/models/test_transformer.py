"""The small vision transformers: shapes, patches, the embedding layer that penalties name, and
exact input-gradient penalties through their attention."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradreg import capture, differentiable_attention
from gradreg.models import TransformerClassifier, ViTCritic
from gradreg.penalties import presets


def test_patches_are_the_image_tiles_in_row_major_order() -> None:
    model = TransformerClassifier(image_shape=(2, 4, 4), patch=2)
    x = torch.arange(32.0).reshape(1, 2, 4, 4)
    tokens = model.patches(x)
    assert tokens.shape == (1, 4, 8)
    # token 1 is the top-right tile: rows 0-1, columns 2-3 of both channels
    torch.testing.assert_close(tokens[0, 1], torch.cat([x[0, c, :2, 2:].flatten()
                                                        for c in range(2)]))


def test_shapes_and_the_embedding_layer() -> None:
    classifier = TransformerClassifier(10, image_shape=(1, 8, 8), patch=2, dim=16, heads=2)
    critic = ViTCritic((1, 16, 16), 16, patch=4, heads=2)
    x = torch.rand(3, 1, 8, 8)
    with capture(classifier, "embed") as activations:
        assert classifier(x).shape == (3, 10)
    assert activations["embed"].shape == (3, 16, 16)
    assert critic(torch.rand(3, 1, 16, 16)).shape == (3, 1)


@pytest.mark.parametrize(("options", "message"), [
    ({"image_shape": (1, 8, 8), "patch": 3}, "multiple of patch"),
    ({"dim": 10, "heads": 4}, "must divide"),
])
def test_bad_shapes_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TransformerClassifier(**options)


def test_double_backprop_on_the_token_embeddings_equals_the_math_backend() -> None:
    torch.manual_seed(0)
    model = TransformerClassifier(image_shape=(1, 8, 8), patch=4, dim=8, heads=2).double()
    x, y = torch.rand(4, 1, 8, 8, dtype=torch.float64), torch.arange(4)
    penalty = presets.intermediate(1.0, layers=["embed"])

    def parameter_gradient(context) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with context(), capture(model, "embed") as activations:
            loss = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        penalty(loss, [activations["embed"]]).backward()
        return [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]

    expected = parameter_gradient(lambda: sdpa_kernel(SDPBackend.MATH))
    for got, want in zip(parameter_gradient(differentiable_attention), expected, strict=True):
        torch.testing.assert_close(got, want)
    assert expected[0].abs().sum() > 0  # the embedding's weight gets the penalty's gradient
