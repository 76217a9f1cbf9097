"""Points at a Hugging Face model's input embeddings (the ``transformers`` extra; skipped without
it): double backprop at ``model.get_input_embeddings()(ids)``, passed to the model as
``inputs_embeds`` and to the penalty as they are, gives every parameter, the embedding matrix
included, the gradient of the task loss plus the penalty written out by autograd (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradreg import GradientError, differentiable_attention
from gradreg.penalties import as_points, double_backprop

transformers = pytest.importorskip("transformers")


def test_double_backprop_at_bert_embeddings_trains_the_embedding_matrix() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=3, attn_implementation="sdpa")
    model = transformers.BertForSequenceClassification(config).double().eval()
    ids = torch.randint(1, 40, (3, 5), generator=torch.Generator().manual_seed(1))  # 0: padding_idx
    labels, mask = torch.tensor([0, 1, 2]), torch.ones(3, 5, dtype=torch.long)
    mask[2, 3:] = 0  # padding

    def per_sample_losses() -> tuple[torch.Tensor, torch.Tensor]:
        embeds = model.get_input_embeddings()(ids)  # kept with its graph: the points as they are
        logits = model(inputs_embeds=embeds, attention_mask=mask).logits
        return F.cross_entropy(logits, labels, reduction="none"), embeds

    with pytest.raises(GradientError, match="as_points got a tensor with a graph"):
        as_points(model.get_input_embeddings()(ids))
    with differentiable_attention():
        losses, embeds = per_sample_losses()
    (losses.mean() + double_backprop(0.1)(losses, embeds)).backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    with sdpa_kernel(SDPBackend.MATH):
        losses, embeds = per_sample_losses()
    (g,) = torch.autograd.grad(losses.sum(), embeds, create_graph=True)
    (losses.mean() + 0.1 * g.square().sum((1, 2)).mean()).backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    assert got.keys() == expected.keys()
    assert "bert.embeddings.word_embeddings.weight" in got
    attended = ids[mask.bool()].unique()  # a token only at padded positions has no gradient
    assert got["bert.embeddings.word_embeddings.weight"][attended].abs().sum(1).min() > 0
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=1e-10, atol=1e-12, msg=name)
