"""gradreg's penalties in Hugging Face's Trainer (gradreg.hf_trainer): a tiny Llama built from a
config (no download) trained two steps, each step's gradient against the hand-written two-pass
recipe in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradreg import GradientError
from gradreg.penalties import gr, param_grad_norm, r1, sam

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer's dependency

from gradreg.hf_trainer import PenalizedTrainer  # noqa: E402

WEIGHT, STEP, BATCH = 0.05, 1e-3, 4


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config).double()


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 32, (BATCH, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return BATCH

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(transformers.TrainerCallback):
    """The parameters at each step's start and the gradient the optimizer is given."""

    def __init__(self) -> None:
        self.params: list[list[torch.Tensor]] = []
        self.grads: list[list[torch.Tensor]] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
        self.params.append([p.detach().clone() for p in model.parameters()])

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs) -> None:
        self.grads.append([p.grad.detach().clone() for p in model.parameters()])


def arguments(tmp_path, **overrides) -> transformers.TrainingArguments:
    options = {"output_dir": str(tmp_path), "max_steps": 2, "per_device_train_batch_size": BATCH,
               "learning_rate": 0.1, "optim": "sgd", "lr_scheduler_type": "constant",
               "max_grad_norm": 0.0, "report_to": [], "save_strategy": "no",
               "logging_strategy": "no", "use_cpu": True, "disable_tqdm": True,
               "dataloader_num_workers": 0}
    return transformers.TrainingArguments(**{**options, **overrides})


def hand_written(model: nn.Module, params: list[torch.Tensor], r: float,
                 alpha: float, *, along_g: bool = False) -> list[torch.Tensor]:
    """``(1-α) ∇L(θ) + α ∇L(θ + r g/‖g‖)`` at ``params`` (``along_g``: ``∇L(θ + r g)``,
    gradientregularization_trl's shift, whose ``(1-α) g + α g'`` with α = λ/ε is their
    ``g + (λ/ε)(g' - g)``), the loss the model's own (mean next-token cross-entropy of the
    whole batch)."""
    with torch.no_grad():
        for p, value in zip(model.parameters(), params, strict=True):
            p.copy_(value)
    ids = Tokens().ids

    def gradient() -> list[torch.Tensor]:
        return list(torch.autograd.grad(model(input_ids=ids, labels=ids).loss,
                                        list(model.parameters())))

    g = gradient()
    norm = 1.0 if along_g else torch.sqrt(sum(t.square().sum() for t in g))
    with torch.no_grad():
        for p, t in zip(model.parameters(), g, strict=True):
            p.add_(t * (r / norm))
    shifted = gradient()
    return [(1 - alpha) * a + alpha * b for a, b in zip(g, shifted, strict=True)]


@pytest.mark.parametrize(("penalty", "r", "alpha", "along_g"), [
    (lambda: param_grad_norm(WEIGHT, method="finite_difference", step=STEP), STEP, WEIGHT / STEP,
     False),
    (lambda: sam(0.05), 0.05, 1.0, False),
    (lambda: gr(1e-4, step=STEP), STEP, 1e-4 / STEP, True)], ids=["gnp", "sam", "gr"])
def test_each_steps_gradient_is_the_hand_written_two_pass_recipe(tmp_path, penalty, r: float,
                                                                alpha: float,
                                                                along_g: bool) -> None:
    model, record = tiny_llama(), Record()
    trainer = PenalizedTrainer(model=model, args=arguments(tmp_path), train_dataset=Tokens(),
                               callbacks=[record], penalties={"p": penalty()})
    trainer.train()
    assert len(record.grads) == 2 and trainer.penalty_values["p"].item() > 0
    reference = tiny_llama()
    for params, grads in zip(record.params, record.grads, strict=True):
        expected = hand_written(reference, params, r, alpha, along_g=along_g)
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    moved = sum((a - b).norm() for a, b in zip(record.params[1], record.params[0], strict=True))
    assert moved > 0  # it trained


def test_evaluation_computes_the_loss_alone(tmp_path) -> None:
    model = tiny_llama()
    trainer = PenalizedTrainer(model=model, args=arguments(tmp_path), eval_dataset=Tokens(),
                               penalties={"sam": sam(0.05)})
    metrics = trainer.evaluate()
    ids = Tokens().ids
    with torch.no_grad():
        plain = model(input_ids=ids, labels=ids).loss.item()
    assert metrics["eval_loss"] == pytest.approx(plain, rel=1e-12)
    assert trainer.penalties["sam"].steps_taken == 0


def test_accumulation_and_other_points_are_refused_in_one_line(tmp_path) -> None:
    with pytest.raises(GradientError, match="a Trainer adds penalties on points='parameters'"):
        PenalizedTrainer(model=tiny_llama(), args=arguments(tmp_path), penalties={"r1": r1()})
    trainer = PenalizedTrainer(model=tiny_llama(),
                               args=arguments(tmp_path, gradient_accumulation_steps=2,
                                              per_device_train_batch_size=2),
                               train_dataset=Tokens(), penalties={"sam": sam(0.05)})
    with pytest.raises(GradientError, match="gradient_accumulation_steps=2 splits"):
        trainer.train()
