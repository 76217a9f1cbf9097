"""Parameter-gradient penalties in Hugging Face's Trainer under gradient accumulation: two
micro-batches of 4 give each optimizer step the gradient of one batch of 8, written out by hand
(float64, a tiny GPT-2 built from a config), where penalizing each micro-batch's own gradient
would not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradreg import GradientError
from gradreg.penalties import double_backprop, param_grad_norm, sam

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gradreg.integrations.hf_trainer import PenalizedTrainer  # noqa: E402
from tests.test_hf_trainer import (  # noqa: E402
    Record,
    Tokens,
    arguments,
    hand_written,
    load,
    next_token_loss,
    tiny_gpt2,
)

WEIGHT = 0.05


def float64_loss(outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """A ``compute_loss_func``: the next-token cross-entropy in float64 (the models' own loss
    is float32), summed over the micro-batch's tokens and divided by the accumulated batch's
    ``num_items_in_batch``, or its mean where not given."""
    logits, labels = outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    if num_items_in_batch is None:
        return F.cross_entropy(logits, labels)
    return F.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch


def exact_gnp(model: torch.nn.Module, params: list[torch.Tensor],
              ids: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of ``L + λ ‖∇L‖`` by double backward, ``L`` the mean next-token
    cross-entropy of the batch ``ids``."""
    load(model, params)
    weights = list(model.parameters())
    with sdpa_kernel(SDPBackend.MATH):  # attention with a double backward
        loss = next_token_loss(model, ids)
        g = torch.autograd.grad(loss, weights, create_graph=True)
        norm = torch.sqrt(sum(t.square().sum() for t in g))
        return list(torch.autograd.grad(loss + WEIGHT * norm, weights))


def micro_batch_penalties(model: torch.nn.Module, params: list[torch.Tensor],
                          ids: torch.Tensor) -> list[torch.Tensor]:
    """What one backward per micro-batch of ``L_k + λ ‖∇L_k‖`` would give: the mean of the two
    halves' exact gradients (another objective)."""
    halves = [exact_gnp(model, params, part) for part in ids.split(4)]
    return [(a + b) / 2 for a, b in zip(*halves, strict=True)]


@pytest.mark.parametrize("normalized", [True, False], ids=["normalized_by_tokens",
                                                           "divided_by_steps"])
@pytest.mark.parametrize(("penalty", "reference"), [
    (lambda: sam(0.05), lambda model, params, ids: hand_written(
        model, params, 0.05, 1.0, ids=ids, loss_of=next_token_loss)),
    (lambda: param_grad_norm(WEIGHT), exact_gnp)], ids=["sam", "gnp_double_backward"])
def test_two_micro_batches_of_4_step_as_one_batch_of_8(tmp_path, penalty, reference,
                                                       normalized: bool) -> None:
    """``normalized_by_tokens``: each micro-batch's summed loss is divided by the tokens of both
    (``num_items_in_batch``); ``divided_by_steps``: each is its micro-batch's mean, which the
    trainer divides by 2. Both must give the gradient of the 8 sequences' mean loss plus the
    penalty of its gradient."""
    model, record, data = tiny_gpt2(), Record(), Tokens(8)
    loss_func = float64_loss if normalized else lambda outputs, labels, **_: float64_loss(
        outputs, labels)
    trainer = PenalizedTrainer(model=model, train_dataset=data, callbacks=[record],
                               args=arguments(tmp_path, gradient_accumulation_steps=2),
                               compute_loss_func=loss_func, penalties={"p": penalty()})
    trainer.loss_is_scaled_for_ga = normalized
    trainer.train()
    assert len(record.grads) == 2  # two optimizer steps of 2 micro-batches each
    other = tiny_gpt2()
    for params, grads in zip(record.params, record.grads, strict=True):
        expected = reference(other, params, data.ids)
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    split = micro_batch_penalties(other, record.params[0], data.ids)
    gap = max((a - b).abs().max() for a, b in zip(split, exact_gnp(other, record.params[0],
                                                                   data.ids), strict=True))
    assert gap > 1e-4  # the per-micro-batch objective is measurably another one


def test_a_per_sample_penalty_is_the_mean_over_the_accumulated_batch(tmp_path) -> None:
    """Double backprop at the input embeddings: 2 x 4 accumulated equals one batch of 8 (the
    gradients of both runs' first steps)."""
    grads = []
    for steps, size in ((2, 4), (1, 8)):
        record = Record()
        trainer = PenalizedTrainer(
            model=tiny_gpt2(), train_dataset=Tokens(8, ignored=3), callbacks=[record],
            args=arguments(tmp_path, max_steps=1, gradient_accumulation_steps=steps,
                           per_device_train_batch_size=size),
            penalties={"db": double_backprop(0.1)})
        trainer.train()
        grads.append(record.grads[0])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


def test_a_lazy_penalty_counts_optimizer_steps(tmp_path) -> None:
    """``due()`` once per optimizer step: 2 steps of 2 micro-batches are 2 steps taken (4 would
    count micro-batches), and with ``every=2`` the second step computes no penalty."""
    trainer = PenalizedTrainer(model=tiny_gpt2(), train_dataset=Tokens(8),
                               args=arguments(tmp_path, gradient_accumulation_steps=2),
                               penalties={"db": double_backprop(0.1, every=2)})
    trainer.train()
    assert trainer.penalties["db"].steps_taken == 2
    assert trainer.penalty_values == {}


class Sentences(torch.utils.data.Dataset):
    """8 sequences of 6 tokens (two padded) with a class label each."""

    def __init__(self) -> None:
        self.ids = torch.randint(1, 40, (8, 6), generator=torch.Generator().manual_seed(2))
        self.mask = torch.ones(8, 6, dtype=torch.long)
        self.mask[2, 4:] = 0
        self.mask[5, 3:] = 0
        self.labels = torch.tensor([0, 1, 2, 1, 2, 0, 0, 1])

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.labels[i]}


def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=3)
    return transformers.BertForSequenceClassification(config).double()


def first_step(tmp_path, model, data, penalties, steps: int, **options) -> list[torch.Tensor]:
    """The gradient of the first optimizer step: ``steps`` micro-batches of 8 / steps."""
    record = Record()
    trainer = PenalizedTrainer(
        model=model, train_dataset=data, callbacks=[record], penalties=penalties,
        args=arguments(tmp_path, max_steps=1, gradient_accumulation_steps=steps,
                       per_device_train_batch_size=8 // steps), **options)
    trainer.train()
    return record.grads[0]


@pytest.mark.parametrize("penalty", [
    lambda: {}, lambda: {"db": double_backprop(0.1)}, lambda: {"sam": sam(0.05)},
    lambda: {"gnp": param_grad_norm(WEIGHT)}], ids=["none", "double_backprop", "sam", "gnp"])
def test_bert_accumulated_follows_the_trainers_scale(tmp_path, penalty) -> None:
    """BERT's classification loss is a micro-batch mean that ignores ``num_items_in_batch``,
    and the trainer, seeing the model accept it, does not divide by the steps: its 2 x 4 step
    is twice one batch of 8's (``none``). Each penalty follows that scale, the gradient of
    2 (L + P) (float64): ``double_backprop(0.1)`` was 0.05 against the doubled task."""
    accumulated = first_step(tmp_path, tiny_bert(), Sentences(), penalty(), 2)
    whole = first_step(tmp_path, tiny_bert(), Sentences(), penalty(), 1)
    for got, want in zip(accumulated, whole, strict=True):
        torch.testing.assert_close(got, 2 * want, rtol=1e-10, atol=1e-13)


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config).double()


@pytest.mark.parametrize(("model", "options", "tolerance"), [
    (tiny_gpt2, {"compute_loss_func": float64_loss}, 1e-10),
    (tiny_llama, {}, 1e-6)], ids=["gpt2_float64_loss_func", "llama_own_loss"])
@pytest.mark.parametrize("penalty", [lambda: {"db": double_backprop(0.1)},
                                     lambda: {"sam": sam(0.05)}], ids=["double_backprop", "sam"])
def test_a_loss_normalized_by_the_token_count_accumulates_to_one_batch(
        tmp_path, model, options, tolerance: float, penalty) -> None:
    """GPT-2 with a float64 ``compute_loss_func`` and Llama's own loss divide by
    ``num_items_in_batch`` (found by the trainer, not declared): 2 x 4 equals one batch of 8,
    to 1e-10 in float64 throughout, to 1e-6 where the model's loss computes in float32."""
    data = Tokens(8, ignored=3)
    accumulated = first_step(tmp_path, model(), data, penalty(), 2, **options)
    whole = first_step(tmp_path, model(), data, penalty(), 1, **options)
    largest = max(t.abs().max() for t in whole)
    for got, want in zip(accumulated, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * largest)


def test_a_loss_neither_normalized_nor_a_mean_is_refused(tmp_path) -> None:
    """A ``compute_loss_func`` dividing by the square root of ``num_items_in_batch``: the
    scale of the accumulated micro-batches is unknown, refused in one line."""
    def odd(outputs, labels, num_items_in_batch=None):
        return float64_loss(outputs, labels, num_items_in_batch) * num_items_in_batch ** 0.5

    with pytest.raises(GradientError, match="neither divides by num_items_in_batch nor "
                                            "ignores it.*loss_is_scaled_for_ga"):
        first_step(tmp_path, tiny_gpt2(), Tokens(8), {"db": double_backprop(0.1)}, 2,
                   compute_loss_func=odd)
