"""gradreg's penalties in TRL's SFTTrainer and GRPOTrainer (skipped where trl is not
installed): the mixin first in the bases, a tiny GPT-2 built from a config, a tokenizer built
in memory, an in-memory dataset; SAM's step is the hand-written two-step recipe on SFT's loss
(the mean next-token cross-entropy, float64), GR's on GRPO's; on 2 processes (slow) both
trainers step as one process with the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradreg import GradientError
from gradreg.penalties import double_backprop, gr, param_grad_norm, sam

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
tokenizers = pytest.importorskip("tokenizers")

from gradreg.integrations.hf_trainer import PenaltyMixin  # noqa: E402
from tests.penalties.ranks_trl import CASES, train  # noqa: E402
from tests.test_hf_trainer import Record, hand_written, load, next_token_loss  # noqa: E402


class SAMSFTTrainer(PenaltyMixin, trl.SFTTrainer):
    pass


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """30 words, a padding and an end token (the tokenizer is needed to build the trainer)."""
    vocab = {**{f"w{i}": i for i in range(30)}, "<pad>": 30, "<eos>": 31}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>",
                                                eos_token="<eos>")


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2,
                                     n_positions=16, bos_token_id=31, eos_token_id=31,
                                     pad_token_id=30, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).double()


IDS = torch.randint(0, 30, (4, 8), generator=torch.Generator().manual_seed(1))


def trainer(tmp_path, penalties, steps: int = 1, checkpointing: bool = True,
            **options) -> SAMSFTTrainer:
    """SFT of the 4 sequences ``IDS`` in batches of 4, or ``steps`` micro-batches of 4/steps
    (``checkpointing``: SFTConfig's default, gradient checkpointing)."""
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2,
                         gradient_checkpointing=checkpointing,
                         per_device_train_batch_size=4 // steps,
                         gradient_accumulation_steps=steps,
                         learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
                         max_grad_norm=0.0, report_to=[], save_strategy="no",
                         logging_strategy="no", use_cpu=True, disable_tqdm=True,
                         dataloader_num_workers=0, bf16=False)  # SFTConfig's default: bf16
    data = datasets.Dataset.from_dict({"input_ids": IDS.tolist()})
    return SAMSFTTrainer(model=tiny_gpt2(), args=args, train_dataset=data,
                         processing_class=tokenizer(), penalties=penalties, **options)


def sft_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """SFT's loss of this batch: the next-token cross-entropy summed over the 28 predicted
    tokens, divided by the trainer's ``num_items_in_batch``, the 32 labels (it counts GPT-2's
    labels unshifted)."""
    return next_token_loss(model, ids) * 28 / 32


@pytest.mark.parametrize("steps", [1, 2], ids=["one_batch", "two_micro_batches"])
def test_sam_in_sft_is_the_hand_written_recipe(tmp_path, steps: int) -> None:
    """Of the batch of 4, also accumulated from two micro-batches of 2. To 1e-6 of the largest
    entry: SFT's fused head computes the log-probabilities in float32 (its loss is the float64
    one's to 6e-8, its gradient to 2e-7 here)."""
    record = Record()
    sft = trainer(tmp_path, {"sam": sam(0.05)}, steps, callbacks=[record])
    sft.train()
    assert len(record.grads) == 2 and sft.penalty_values["sam"] > 0
    reference = tiny_gpt2()
    for params, grads in zip(record.params, record.grads, strict=True):
        expected = hand_written(reference, params, 0.05, 1.0, ids=IDS, loss_of=sft_loss)
        largest = max(want.abs().max() for want in expected)
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * largest)


def test_penalties_at_the_embeddings_are_refused_before_training(tmp_path) -> None:
    """SFTTrainer computes its loss by a fused head and hands back logits of a no-grad
    forward: nothing to differentiate at the embeddings; refused when the trainer is built,
    naming the penalties that work."""
    with pytest.raises(GradientError, match="differentiates the logits.*fused LM head.*sam, "
                                            "asam, gr, or param_grad_norm"):
        trainer(tmp_path, {"db": double_backprop(0.1)})


def test_an_exact_parameter_penalty_is_refused_before_training(tmp_path) -> None:
    """``param_grad_norm``'s default method differentiates SFT's loss twice, through trl's
    chunked log-probability kernel, which has no double backward (``mm(): functions with
    out=...``): refused in one line when the trainer is built, naming what works."""
    with pytest.raises(GradientError, match="no double backward: use penalties on "
                                            "points='parameters' by finite difference.*"
                                            "compute_loss_func"):
        trainer(tmp_path, {"gnp": param_grad_norm(0.05)})


def test_gr_by_double_backward_names_its_exact_form() -> None:
    with pytest.raises(ValueError, match=r"param_grad_norm\(0.01, power=2, gain=0.5\)"):
        gr(0.01, method="double_backward")


def float64_sft_loss(outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """SFT's loss from the logits, in float64: the next-token cross-entropy summed, divided by
    ``num_items_in_batch``."""
    logits, labels = outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch


def test_an_exact_parameter_penalty_with_the_loss_from_the_logits(tmp_path) -> None:
    """With ``compute_loss_func`` SFT computes its loss from the logits, which the exact
    ``param_grad_norm`` differentiates twice: each step's gradient is that of
    ``L + λ‖∇L‖`` by double backward (float64). Not under gradient checkpointing (SFT's
    default), whose recomputed forward runs another attention kernel: refused in one line."""
    record = Record()
    with pytest.raises(GradientError, match="gradient checkpointing recomputes that forward.*"
                                            "gradient_checkpointing=False"):
        trainer(tmp_path, {"gnp": param_grad_norm(0.05)}, compute_loss_func=float64_sft_loss)
    sft = trainer(tmp_path, {"gnp": param_grad_norm(0.05)}, checkpointing=False, callbacks=[record],
                  compute_loss_func=float64_sft_loss)
    sft.train()
    reference = tiny_gpt2()
    for params, grads in zip(record.params, record.grads, strict=True):
        load(reference, params)
        weights = list(reference.parameters())
        with sdpa_kernel(SDPBackend.MATH):
            loss = sft_loss(reference, IDS)
            g = torch.autograd.grad(loss, weights, create_graph=True)
            norm = torch.sqrt(sum(t.square().sum() for t in g))
            expected = torch.autograd.grad(loss + 0.05 * norm, weights)
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


class Kept(PenaltyMixin, trl.GRPOTrainer):
    """GRPO with the mixin, keeping the inputs of its last loss (the generated batch)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.kept = dict(inputs)
        return super().compute_loss(model, inputs, *args, **kwargs)


def test_gr_in_grpo_is_the_hand_written_recipe(tmp_path) -> None:
    """``gr`` (λ = ε = 1e-3) in GRPOTrainer on a tiny GPT-2 with a reward of the completion's
    length: the step's gradient is gradientregularization_trl's ``g + (λ/ε)(∇L(θ + ε g) - g)``
    of GRPO's own loss on the generated batch (the plain trainer's ``compute_loss``), to 1e-6
    of its largest entry (GRPO's fused head computes its log-probabilities in float32;
    measured 2e-19). One process; two in test_two_processes_step_as_one."""
    args = trl.GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=4, learning_rate=0.1,
                          optim="sgd", max_grad_norm=0.0, report_to=[], save_strategy="no",
                          logging_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False,
                          gradient_checkpointing=False)
    data = datasets.Dataset.from_dict({"prompt": ["w1 w2", "w3 w4", "w5", "w6 w7"]})
    record = Record()
    grpo = Kept(model=tiny_gpt2(), args=args, train_dataset=data, processing_class=tokenizer(),
                reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                penalties={"gr": gr(1e-3, step=1e-3)}, callbacks=[record])
    grpo.train()
    assert grpo.penalty_values["gr"] > 0
    model, params = grpo.model, record.params[0]

    def gradient() -> list[torch.Tensor]:
        model.zero_grad()
        loss = trl.GRPOTrainer.compute_loss(grpo, model, dict(grpo.kept))
        return list(torch.autograd.grad(loss, list(model.parameters())))

    load(model, params)
    model.train()  # GRPO normalizes its loss by the mode
    g = gradient()
    with torch.no_grad():
        for p, t in zip(model.parameters(), g, strict=True):
            p.add_(t, alpha=1e-3)
    shifted = gradient()
    expected = [a + (b - a) for a, b in zip(g, shifted, strict=True)]  # λ/ε = 1
    largest = max(t.abs().max() for t in expected)
    for got, want in zip(record.grads[0], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * largest)
    assert max((a - b).abs().max() for a, b in zip(record.grads[0], g, strict=True)) \
        > 1e-3 * largest  # the penalty moves the step (2.4e-2 here)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case of ``ranks_trl`` on 2 gloo processes, in one launch."""
    import sys
    from pathlib import Path

    from tests.distributed import run_processes

    out = tmp_path_factory.mktemp("trl")
    run_processes([sys.executable, "-m", "tests.penalties.ranks_trl", str(out), ",".join(CASES)],
                  [{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                    "LOCAL_WORLD_SIZE": "2"} for rank in (0, 1)],
                  cwd=Path(__file__).resolve().parents[1], timeout=600)
    return torch.load(out / "trl.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_processes_step_as_one(tmp_path, two_processes: dict, case: str) -> None:
    """TRL's trainers with the mixin on 2 gloo processes, each with half of the global batch of
    8, against one process with all of it (``tests.penalties.ranks_trl``): GRPO with ``gr``
    (4 completions per process, one prompt's group), SFT with ``sam`` (also accumulated from
    two micro-batches per process) and with ``gr``, its 8 sequences of unequal lengths (the
    ranks' token counts differ). Each step's gradient (DDP's mean) and the parameters' change
    over the run equal to 1e-6 of their largest entry, the penalty's value to 1e-6: the fused
    heads compute the log-probabilities in float32 (measured: gradients 4e-8 to 2e-7, the
    change 4e-8 to 1.1e-7, the value 2e-9 to 1.3e-8). The penalty moves each step by more than
    1e-3 of its largest entry (7e-3 to 1 here), so the comparison is not of the trainers' own
    steps."""
    grads, final, value = two_processes[case]
    want_grads, want_final, want_value = train(case, 1, str(tmp_path / "one"))
    plain, _, _ = train(case, 1, str(tmp_path / "plain"), penalized=False)
    assert len(grads) == len(want_grads) == len(plain) == (1 if case.startswith("grpo") else 2)
    for got, want, own in zip(grads, want_grads, plain, strict=True):
        largest = max(t.abs().max() for t in want).item()
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * largest)
        assert max((b - c).abs().max() for b, c in zip(want, own, strict=True)) > 1e-3 * largest
    start = list(tiny_gpt2().parameters())
    change = [a - s for a, s in zip(final, start, strict=True)]
    want_change = [b - s for b, s in zip(want_final, start, strict=True)]
    largest = max(t.abs().max() for t in want_change).item()
    for a, b in zip(change, want_change, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * largest)
    torch.testing.assert_close(value, want_value, rtol=1e-6, atol=0)
