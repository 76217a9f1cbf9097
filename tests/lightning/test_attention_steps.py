"""The Lightning modules enter differentiable attention only for a forward whose graph a due
penalty differentiates twice; their penalties through attention equal the MATH backend's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradreg.graph import walk_backward_graph
from gradreg.lightning.classifier import Classifier
from gradreg.lightning.gan_loss import GANLoss
from gradreg.models import TransformerClassifier, ViTCritic
from gradreg.penalties import presets


def routed(output: torch.Tensor) -> bool:
    """Whether the graph of ``output`` runs through gradreg's differentiable attention."""
    return any(type(node).__name__ == "_AttentionBackward"
               for node in walk_backward_graph([output]).nodes)


def parameter_gradients(module: nn.Module, total: torch.Tensor) -> list[torch.Tensor]:
    params = list(module.parameters())
    grads = torch.autograd.grad(total, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


@pytest.mark.parametrize("name", ["double_backprop", "param_grad_norm"])
def test_a_classifier_step_through_attention_equals_the_math_backend(name: str) -> None:
    torch.manual_seed(0)
    backbone = TransformerClassifier(image_shape=(1, 8, 8), patch=4, dim=8, heads=2).double()
    x, y = torch.rand(4, 1, 8, 8, dtype=torch.float64), torch.arange(4)

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        module = Classifier(backbone, {name: presets.make_penalty(name, weight=1.0, every=2)})
        loss, penalties = module.losses(x, y)
        total = loss + sum(penalties.values())
        return loss, parameter_gradients(backbone, total)

    loss, got = step()
    assert routed(loss)
    with sdpa_kernel(SDPBackend.MATH):
        _, expected = step()
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)

    module = Classifier(backbone, {name: presets.make_penalty(name, weight=1.0, every=2)})
    module.losses(x, y)
    loss, penalties = module.losses(x, y)  # not due: the task loss keeps the fused kernel
    assert not penalties and not routed(loss)


def test_the_critic_phase_routes_only_the_forward_r1_differentiates() -> None:
    torch.manual_seed(0)
    critic = ViTCritic((1, 8, 8), 8, patch=4, heads=2).double()
    generator = nn.Sequential(nn.Linear(2, 64), nn.Unflatten(1, (1, 8, 8))).double()
    real = torch.rand(4, 1, 8, 8, dtype=torch.float64)

    def critic_gradients() -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(1)
        loss = GANLoss(generator, critic, {"r1": presets.r1(10.0)}, adversarial="nonsaturating")
        terms = loss.critic_terms(real)
        return terms, parameter_gradients(critic, sum(terms.values()))

    terms, got = critic_gradients()
    with sdpa_kernel(SDPBackend.MATH):
        expected_terms, expected = critic_gradients()
    torch.testing.assert_close(terms["r1"], expected_terms["r1"])
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert routed(terms["r1"])


def test_the_critic_forward_at_fakes_keeps_the_fused_kernel() -> None:
    torch.manual_seed(0)
    critic = ViTCritic((1, 8, 8), 8, patch=4, heads=2)
    seen = []
    critic.register_forward_hook(lambda m, args, out: seen.append(out))
    generator = nn.Sequential(nn.Linear(2, 64), nn.Unflatten(1, (1, 8, 8)))
    GANLoss(generator, critic, {"r1": presets.r1(10.0)}).critic_terms(torch.rand(4, 1, 8, 8))
    real_scores, fake_scores = seen
    assert routed(real_scores) and not routed(fake_scores)
