"""Exact penalties through a Hugging Face model's ``"sdpa"`` attention (the ``transformers``
extra; skipped without it): R1 at the input embeddings of a BERT built from a config, with a
padding mask, equals the same model with MATH attention everywhere (float64)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradreg import GradientError, differentiable_attention
from gradreg.penalties import presets

transformers = pytest.importorskip("transformers")


def test_r1_through_bert_sdpa_attention_equals_the_math_backend() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa")
    model = transformers.BertModel(config).double().eval()
    assert model.config._attn_implementation == "sdpa"
    readout = torch.randn(5, 16, dtype=torch.float64)
    embeddings = torch.randn(3, 5, 16, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, 3:] = 0  # padding

    def r1(context) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        x = embeddings.clone().requires_grad_()
        with context():
            hidden = model(inputs_embeds=x, attention_mask=mask).last_hidden_state
        value = presets.r1(10.0)(((hidden * readout).sum(dim=(1, 2))), x)
        value.backward()
        return value.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with pytest.raises(GradientError, match="differentiable_attention"):
        r1(torch.enable_grad)  # the fused kernel alone
    value, grads = r1(differentiable_attention)
    expected_value, expected = r1(lambda: sdpa_kernel(SDPBackend.MATH))
    torch.testing.assert_close(value, expected_value)
    assert len(grads) == len(expected) > 0
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)
