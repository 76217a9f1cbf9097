"""gradreg's penalties in Hugging Face's Trainer (gradreg.integrations.hf_trainer): a tiny Llama
built from a config (no download) trained two steps, each step's gradient against the
hand-written two-pass recipe in float64."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradreg import GradientError
from gradreg.penalties import double_backprop, gr, intermediate, param_grad_norm, r1, sam

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer's dependency

from gradreg.integrations.hf_trainer import PenalizedTrainer  # noqa: E402

WEIGHT, STEP, BATCH = 0.05, 1e-3, 4


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config).double()


def tiny_gpt2() -> nn.Module:
    """A causal LM in float64 throughout (Llama's RMSNorm computes in float32 even in a float64
    model, which leaves second derivatives ~1e-7 apart between equal forms)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2,
                                     n_positions=16, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).double()


class Tokens(torch.utils.data.Dataset):
    """``size`` sequences of 8 tokens, labelled with themselves (``ignored``: the labels of the
    first ``ignored`` positions of every other sequence set to -100). Position 0, never a
    next-token target, is -100: the trainer counts 7 tokens a sequence whether or not it
    shifts the labels (``num_items_in_batch``)."""

    def __init__(self, size: int = BATCH, ignored: int = 1) -> None:
        self.ids = torch.randint(0, 32, (size, 8), generator=torch.Generator().manual_seed(1))
        self.labels = self.ids.clone()
        self.labels[:, 0] = -100
        self.labels[::2, :ignored] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Record(transformers.TrainerCallback):
    """The parameters at each step's start and the gradient the optimizer is given (of the
    trainable ones)."""

    def __init__(self) -> None:
        self.params: list[list[torch.Tensor]] = []
        self.grads: list[list[torch.Tensor]] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
        self.params.append([p.detach().clone() for p in model.parameters()])

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs) -> None:
        self.grads.append([p.grad.detach().clone() for p in model.parameters()
                           if p.requires_grad])


def arguments(tmp_path, **overrides) -> transformers.TrainingArguments:
    options = {"output_dir": str(tmp_path), "max_steps": 2, "per_device_train_batch_size": BATCH,
               "learning_rate": 0.1, "optim": "sgd", "lr_scheduler_type": "constant",
               "max_grad_norm": 0.0, "report_to": [], "save_strategy": "no",
               "logging_strategy": "no", "use_cpu": True, "disable_tqdm": True,
               "dataloader_num_workers": 0}
    return transformers.TrainingArguments(**{**options, **overrides})


def load(model: nn.Module, params: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, value in zip(model.parameters(), params, strict=True):
            p.copy_(value)


def own_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own loss (transformers computes it in float32)."""
    return model(input_ids=ids, labels=ids).loss


def next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of ``ids`` in the model's dtype (float64), written out."""
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def hand_written(model: nn.Module, params: list[torch.Tensor], r: float,
                 alpha: float, *, along_g: bool = False, ids: torch.Tensor | None = None,
                 loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor] = own_loss
                 ) -> list[torch.Tensor]:
    """``(1-α) ∇L(θ) + α ∇L(θ + r g/‖g‖)`` at ``params`` (``along_g``: ``∇L(θ + r g)``,
    gradientregularization_trl's shift, whose ``(1-α) g + α g'`` with α = λ/ε is their
    ``g + (λ/ε)(g' - g)``), ``L`` the mean next-token cross-entropy ``loss_of`` the whole
    batch ``ids`` (default :class:`Tokens`)."""
    load(model, params)
    ids = Tokens().ids if ids is None else ids

    def gradient() -> list[torch.Tensor]:
        return list(torch.autograd.grad(loss_of(model, ids), list(model.parameters())))

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


def test_what_a_trainer_cannot_evaluate_is_refused_in_one_line(tmp_path) -> None:
    with pytest.raises(GradientError, match="points='real', which belong to a GAN"):
        PenalizedTrainer(model=tiny_llama(), args=arguments(tmp_path), penalties={"r1": r1()})
    with pytest.raises(GradientError, match="layers=\\['nowhere'\\], not submodules"):
        PenalizedTrainer(model=tiny_llama(), args=arguments(tmp_path),
                         penalties={"h": intermediate(layers=["nowhere"])})
    backbone = transformers.LlamaModel(tiny_llama().config)  # no head: no known loss
    with pytest.raises(GradientError, match="not LlamaModel: pass per_sample_loss="):
        PenalizedTrainer(model=backbone, args=arguments(tmp_path),
                         penalties={"db": double_backprop(0.1)})
    layer = "model.layers.0.mlp"
    with pytest.raises(GradientError, match="asks for its own forward"):
        PenalizedTrainer(model=tiny_llama(), args=arguments(tmp_path),
                         penalties={"h": intermediate(layers=[layer], chunks=2)})


@pytest.mark.parametrize(("penalties", "match"), [
    ({"sam": sam(0.05), "gnp": param_grad_norm(0.01)},
     r"\['gnp', 'sam'\] with 2 micro-batches per optimizer step"),
    ({"db": double_backprop(0.1, reduction="max")}, "maximum over samples, which 2 micro-batches")],
    ids=["two_parameter_penalties", "max"])
def test_accumulation_refuses_what_it_cannot_split_in_one_line(tmp_path, penalties,
                                                               match: str) -> None:
    trainer = PenalizedTrainer(model=tiny_llama(),
                               args=arguments(tmp_path, gradient_accumulation_steps=2,
                                              per_device_train_batch_size=2),
                               train_dataset=Tokens(), penalties=penalties)
    with pytest.raises(GradientError, match=match):
        trainer.train()


def test_two_parameter_penalties_on_several_processes_are_refused(tmp_path,
                                                                  monkeypatch) -> None:
    """The whole batch's gradient is taken for one parameter penalty."""
    trainer = PenalizedTrainer(model=tiny_llama(), args=arguments(tmp_path),
                               train_dataset=Tokens(),
                               penalties={"sam": sam(0.05), "gnp": param_grad_norm(0.01)})
    monkeypatch.setattr(type(trainer.args), "world_size", property(lambda self: 2))
    with pytest.raises(GradientError,
                       match=r"penalties \['gnp', 'sam'\] with the batch split over processes"):
        trainer.train()


@pytest.mark.parametrize(("engine", "penalty", "match"), [
    ("zero2", double_backprop(0.1), "differentiates the trainer's forward twice, .*: train with "
                                    "DDP .* or FSDP2 .*; or use a parameter penalty"),
    ("zero3", param_grad_norm(0.05), "differentiates the parameters twice, which DeepSpeed "
                                     "ZeRO-3 cannot .*: use method='finite_difference'"),
    ("fsdp1", sam(0.05), "not taken under FSDP1 yet: train with DDP")],
    ids=["deepspeed_inputs", "zero3_parameters", "fsdp1_parameters"])
def test_what_an_engine_cannot_take_is_refused_before_training(tmp_path, monkeypatch,
                                                               engine: str, penalty,
                                                               match: str) -> None:
    """The engine stated as the trainer states it (DeepSpeed's ZeRO stage, FSDP's version);
    DeepSpeed itself in tests/test_hf_deepspeed.py."""
    from gradreg.integrations import hf_trainer

    trainer = PenalizedTrainer(model=tiny_llama(), args=arguments(tmp_path))
    if engine == "fsdp1":
        trainer.is_fsdp_enabled = True
        trainer.args.fsdp_config = {"version": 1}
    else:
        monkeypatch.setattr(hf_trainer, "_zero_stage", lambda _trainer: int(engine[-1]))
    with pytest.raises(GradientError, match=match):
        trainer._check("p", penalty, trainer.model)


def gr_trl_twin(model: nn.Module, params: list[torch.Tensor], strength: float, eps: float,
                excluded: tuple[str, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """gradientregularization_trl's step written out (their clipping to norm 10 checked
    inactive): g1 = ∇L(θ), the included parameters (names without ``excluded`` parts) shifted
    by ε g1, g2 = ∇L there; an included parameter gets g1 + (λ/ε)(g2 - g1), an excluded one
    keeps g2 (their ``.grad`` after the shifted backward). Returns theirs and g1."""
    load(model, params)
    weights = dict(model.named_parameters())
    ids = Tokens().ids

    def gradient() -> list[torch.Tensor]:
        return list(torch.autograd.grad(own_loss(model, ids), list(weights.values())))

    g1 = gradient()
    included = [not any(part in name for part in excluded) for name in weights]
    with torch.no_grad():
        for p, t, inside in zip(weights.values(), g1, included, strict=True):
            if inside:
                p.add_(t, alpha=eps)
    g2 = gradient()
    for g in (g1, g2):
        assert torch.sqrt(sum(t.square().sum() for t in g)) < 10  # their clipping inactive
    theirs = [a + (strength / eps) * (b - a) if inside else b
              for a, b, inside in zip(g1, g2, included, strict=True)]
    return theirs, g1


def test_penalty_parameters_match_gradientregularization_trls_default(tmp_path) -> None:
    """``penalty_parameters=excluding(*GR_TRL_EXCLUDED)``: Llama's embeddings and output layer
    are neither penalized nor shifted. Each step's gradient equals gradientregularization_trl's
    on the penalized parameters (float64, 1e-9); the excluded ones take the task's gradient at
    θ, where theirs take it at the shifted point, ∇L(θ + ε g) = ∇L(θ) + ε H g + O(ε²)."""
    from gradreg.integrations.hf_trainer import GR_TRL_EXCLUDED, excluding

    strength, eps = 1e-4, STEP
    model, record = tiny_llama(), Record()
    trainer = PenalizedTrainer(model=model, args=arguments(tmp_path), train_dataset=Tokens(),
                               callbacks=[record], penalties={"gr": gr(strength, step=eps)},
                               penalty_parameters=excluding(*GR_TRL_EXCLUDED))
    trainer.train()
    names = [name for name, _ in model.named_parameters()]
    outside = {"model.embed_tokens.weight", "lm_head.weight"}
    assert {n for n in names if any(part in n for part in GR_TRL_EXCLUDED)} == outside
    reference = tiny_llama()
    for params, grads in zip(record.params, record.grads, strict=True):
        theirs, task = gr_trl_twin(reference, params, strength, eps, GR_TRL_EXCLUDED)
        for name, got, want, plain in zip(names, grads, theirs, task, strict=True):
            torch.testing.assert_close(got, plain if name in outside else want,
                                       rtol=1e-9, atol=1e-12)
            if name in outside:  # theirs: the gradient at the shifted point
                assert 0 < (want - plain).abs().max() < 1e-2 * plain.abs().max()


def test_penalty_parameters_selecting_none_are_refused(tmp_path) -> None:
    trainer = PenalizedTrainer(model=tiny_llama(), args=arguments(tmp_path),
                               train_dataset=Tokens(), penalties={"sam": sam(0.05)},
                               penalty_parameters=lambda name, p: False)
    with pytest.raises(GradientError, match="penalty_parameters selects none"):
        trainer.train()
