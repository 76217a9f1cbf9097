"""Penalties at the input embeddings and at activations in Hugging Face's Trainer: each step's
gradient equals the task loss plus the penalty written out by autograd here (the per-sample
losses by hand, the points recorded by a hook of the test's own), float64, tiny models built
from configs: a causal LM (GPT-2, labels shifted, -100 ignored) and a sequence classifier
(BERT, padded)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradreg import GradientError
from gradreg.penalties import double_backprop, intermediate, jacobian

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gradreg.integrations.hf_trainer import PenalizedTrainer  # noqa: E402
from tests.test_hf_trainer import Record, Tokens, arguments, load, tiny_gpt2  # noqa: E402

LAMBDA = 0.1


def tiny_bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=3)
    return transformers.BertForSequenceClassification(config).double()


class Sentences(torch.utils.data.Dataset):
    """4 padded sequences of 5 tokens with a class label each."""

    def __init__(self) -> None:
        self.ids = torch.randint(1, 40, (4, 5), generator=torch.Generator().manual_seed(1))
        self.mask = torch.ones(4, 5, dtype=torch.long)
        self.mask[2, 3:] = 0
        self.mask[3, 4:] = 0
        self.labels = torch.tensor([0, 1, 2, 1])

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.labels[i]}


def next_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per sequence, the mean cross-entropy of its tokens t whose label t+1 is not -100."""
    losses = []
    for z, y in zip(logits, labels, strict=True):
        kept = y[1:] != -100
        losses.append(F.cross_entropy(z[:-1][kept], y[1:][kept]))
    return torch.stack(losses)


def square_gradient_norms(outputs: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """``‖∇_{p_i} Σ outputs‖²`` per sample, differentiable (a double backward to come)."""
    (g,) = torch.autograd.grad(outputs.sum(), points, create_graph=True)
    return g.square().flatten(1).sum(1)


def embedded(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, object]:
    """The input embeddings (kept with their graph, a leaf where frozen) and the model's outputs
    from them, task loss included."""
    embeds = model.get_input_embeddings()(batch["input_ids"])
    if not embeds.requires_grad:  # frozen embeddings: a leaf
        embeds.requires_grad_()
    rest = {k: v for k, v in batch.items() if k != "input_ids"}
    return embeds, model(inputs_embeds=embeds, **rest)


def expected_gradients(model: nn.Module, params: list[torch.Tensor], batch: dict,
                       penalty: Callable[[nn.Module, dict], torch.Tensor]
                       ) -> tuple[list[torch.Tensor], torch.Tensor]:
    load(model, params)
    trainable = [p for p in model.parameters() if p.requires_grad]
    with sdpa_kernel(SDPBackend.MATH):
        task, value = penalty(model, batch)
        grads = torch.autograd.grad(task + value, trainable, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g
            for p, g in zip(trainable, grads, strict=True)], value.detach()


def run(tmp_path, model: nn.Module, data, penalty) -> tuple[Record, PenalizedTrainer]:
    record = Record()
    trainer = PenalizedTrainer(model=model, args=arguments(tmp_path), train_dataset=data,
                               callbacks=[record], penalties={"p": penalty})
    trainer.train()
    return record, trainer


def check(record: Record, trainer: PenalizedTrainer, reference: nn.Module, batch: dict,
          penalty: Callable[[nn.Module, dict], torch.Tensor], rtol: float = 1e-10) -> None:
    """Each step's gradient is the reference's to ``rtol`` (absolute: of its largest entry);
    the latest step's penalty value equals the reference's."""
    assert len(record.grads) == 2
    for params, grads in zip(record.params, record.grads, strict=True):
        expected, value = expected_gradients(reference, params, batch, penalty)
        largest = max(want.abs().max() for want in expected)
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * largest)
    assert value > 0
    torch.testing.assert_close(trainer.penalty_values["p"], value, rtol=1e-10, atol=0)


def lm_batch() -> dict[str, torch.Tensor]:
    data = Tokens(4, ignored=3)
    return {"input_ids": data.ids, "labels": data.labels}


def double_backprop_lm(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    embeds, outputs = embedded(model, batch)
    losses = next_token_losses(outputs.logits, batch["labels"])
    return outputs.loss, LAMBDA * square_gradient_norms(losses, embeds).mean()


@pytest.mark.parametrize("options", [{}, {"chunks": 2}], ids=["shared_forward", "own_forward"])
def test_double_backprop_at_a_causal_lm_embeddings(tmp_path, options: dict) -> None:
    """λ mean_i ‖∇_{e_i} ℓ_i‖², ℓ_i the mean next-token loss of sequence i over its counted
    tokens (the first 3 labels of every other sequence are -100); ``chunks=2``: the penalty's
    own forwards, from ``inputs_embeds`` with the labels split alongside."""
    record, trainer = run(tmp_path, tiny_gpt2(), Tokens(4, ignored=3),
                          double_backprop(LAMBDA, **options))
    check(record, trainer, tiny_gpt2(), lm_batch(), double_backprop_lm)


def test_the_jacobian_of_a_classifiers_logits_at_its_embeddings(tmp_path) -> None:
    """λ mean_i ‖∂z_i/∂e_i‖_F² of the 3 logits, exact with 3 orthonormal projections, the
    Jacobian written out one logit at a time; padded positions are embeddings too."""
    data = Sentences()
    batch = {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}

    def penalty(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, outputs = embedded(model, batch)
        squares = sum(square_gradient_norms(outputs.logits[:, c], embeds) for c in range(3))
        return outputs.loss, 0.01 * squares.mean()

    record, trainer = run(tmp_path, tiny_bert(), data, jacobian(0.01, count=3))
    check(record, trainer, tiny_bert(), batch, penalty)


def test_double_backprop_of_a_classifiers_losses_at_its_embeddings(tmp_path) -> None:
    data = Sentences()
    batch = {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}

    def penalty(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, outputs = embedded(model, batch)
        losses = F.cross_entropy(outputs.logits, batch["labels"], reduction="none")
        return outputs.loss, LAMBDA * square_gradient_norms(losses, embeds).mean()

    record, trainer = run(tmp_path, tiny_bert(), data, double_backprop(LAMBDA))
    check(record, trainer, tiny_bert(), batch, penalty)


def test_the_input_gradient_at_a_hidden_layer(tmp_path) -> None:
    """``intermediate`` at GPT-2's MLP output: λ mean_i ‖∇_{h_i} ℓ_i‖², h recorded here by a
    forward hook."""
    layer = "transformer.h.0.mlp"

    def penalty(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        seen = []
        handle = model.get_submodule(layer).register_forward_hook(
            lambda module, args, output: seen.append(output))
        try:
            outputs = model(**batch)
        finally:
            handle.remove()
        losses = next_token_losses(outputs.logits, batch["labels"])
        return outputs.loss, LAMBDA * square_gradient_norms(losses, seen[0]).mean()

    record, trainer = run(tmp_path, tiny_gpt2(), Tokens(4, ignored=3),
                          intermediate(LAMBDA, layers=[layer]))
    check(record, trainer, tiny_gpt2(), lm_batch(), penalty)


def frozen_gpt2() -> nn.Module:
    model = tiny_gpt2()
    model.get_input_embeddings().weight.requires_grad_(False)  # tied: the LM head too
    return model


def test_finite_differences_at_frozen_embeddings(tmp_path) -> None:
    """By ``method="finite_difference"`` (the trainer's forward shared, one more at shifted
    embeddings): the value exact, the gradient the exact one's to 1e-4 (measured here: 1.5e-5
    of each parameter's largest entry, the difference quotient's truncation)."""
    record, trainer = run(tmp_path, frozen_gpt2(), Tokens(4, ignored=3),
                          double_backprop(LAMBDA, method="finite_difference"))
    check(record, trainer, frozen_gpt2(), lm_batch(), double_backprop_lm, rtol=1e-4)


def test_finite_differences_at_trainable_embeddings(tmp_path) -> None:
    """At trainable (tied) embeddings the estimate's gradient reaches the embedding matrix
    through the shifted embeddings: every parameter's gradient, the matrix's included, the
    exact one's to 1e-4 of each parameter's largest entry."""
    record, trainer = run(tmp_path, tiny_gpt2(), Tokens(4, ignored=3),
                          double_backprop(LAMBDA, method="finite_difference"))
    check(record, trainer, tiny_gpt2(), lm_batch(), double_backprop_lm, rtol=1e-4)


class Masked(torch.utils.data.Dataset):
    """4 sequences of 5 tokens whose labels are the tokens at 2 or 3 positions, -100 elsewhere."""

    def __init__(self) -> None:
        self.ids = torch.randint(1, 40, (4, 5), generator=torch.Generator().manual_seed(2))
        self.labels = torch.full_like(self.ids, -100)
        self.labels[:, ::2] = self.ids[:, ::2]
        self.labels[1, 2] = -100

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def test_a_head_of_its_own_takes_per_sample_loss(tmp_path) -> None:
    """A masked LM (no per-sample loss known to gradreg): refused without ``per_sample_loss``;
    with it, double backprop of those losses, written out here one sequence at a time."""
    config = tiny_bert().config

    def masked_lm() -> nn.Module:
        torch.manual_seed(0)
        return transformers.BertForMaskedLM(config).double()

    def per_sample_loss(outputs, inputs) -> torch.Tensor:
        labels = inputs["labels"]
        tokens = F.cross_entropy(outputs["logits"].transpose(1, 2), labels, reduction="none")
        return tokens.sum(1) / labels.ne(-100).sum(1)

    def penalty(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, outputs = embedded(model, batch)
        losses = torch.stack([F.cross_entropy(z[y != -100], y[y != -100])
                              for z, y in zip(outputs.logits, batch["labels"], strict=True)])
        return outputs.loss, LAMBDA * square_gradient_norms(losses, embeds).mean()

    with pytest.raises(GradientError, match="not BertForMaskedLM: pass per_sample_loss="):
        PenalizedTrainer(model=masked_lm(), args=arguments(tmp_path), train_dataset=Masked(),
                         penalties={"p": double_backprop(LAMBDA)})
    data, record = Masked(), Record()
    trainer = PenalizedTrainer(model=masked_lm(), args=arguments(tmp_path), train_dataset=data,
                               callbacks=[record], penalties={"p": double_backprop(LAMBDA)},
                               per_sample_loss=per_sample_loss)
    trainer.train()
    check(record, trainer, masked_lm(), {"input_ids": data.ids, "labels": data.labels},
          penalty)
