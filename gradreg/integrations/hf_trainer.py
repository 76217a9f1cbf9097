r"""Any gradreg penalty in Hugging Face's ``Trainer``, without a ``compute_loss`` of the user's.

:class:`PenaltyMixin` adds penalties to ``transformers.Trainer`` or a trainer built on it (TRL's
``SFTTrainer``: the mixin first in the bases)::

    from gradreg.integrations.hf_trainer import PenalizedTrainer
    from gradreg.penalties import double_backprop, param_grad_norm, sam

    trainer = PenalizedTrainer(model=model, args=args, train_dataset=data,
                               penalties={"sam": sam(0.05),
                                          "db": double_backprop(0.1)})
    trainer.train()

    class SAMSFTTrainer(PenaltyMixin, SFTTrainer): ...

In training, the trainer's own loss :math:`L` (``super().compute_loss``: the model's loss, or
``compute_loss_func``, normalized as the trainer normalizes it) becomes :math:`L + \sum_k P_k`,
each penalty due at the optimizer step (``penalty.due()``, called on the first micro-batch of
each step) evaluated where its ``points`` say. The trainer runs its forward; which entry takes
which penalty is the core's :func:`gradreg.penalties.penalty_terms`, given that forward (a
:class:`~gradreg.penalties.StepForward` whose points are the input embeddings) and the step's
:class:`~gradreg.penalties.Window` of micro-batches and ranks:

* ``"parameters"`` (``param_grad_norm``, ``sam``, ``asam``, ``gr``): of the gradient of
  :math:`L` w.r.t. the parameters that require grad (those ``penalty_parameters`` selects,
  e.g. ``excluding(*GR_TRL_EXCLUDED)`` for gradientregularization_trl's default; the others
  take the task's gradient alone). The loss at shifted parameters is the same
  call on the same inputs, its forward drawing the random numbers of the first (dropout's masks)
  and leaving BatchNorm's running statistics as one forward does. The first finite-difference
  penalty takes the loss's gradient for the trainer (``penalized_loss``): the step costs the
  hand-written two passes, and the trainer's backward, clipping and optimizer run unchanged.
* ``"inputs"``: at the outputs :math:`e` of ``model.get_input_embeddings()`` (the tensor as the
  model computed it, recorded by a forward hook; the rest of the forward gets a copy), of the
  per-sample losses :math:`\ell_i` (``of="loss"``: double backprop,
  :math:`\lVert \nabla_{e_i} \ell_i \rVert^2`) or of the logits (``of="outputs"``). The methods
  that run their own forward call the model with ``inputs_embeds``, the batch's other
  per-sample tensors (attention mask, labels) passed along.
* ``"activations"``: at the outputs of the named submodules (``layers``) of the per-sample
  losses.

The per-sample losses are computed here from the logits and the labels (:func:`per_sample_losses`):
for causal language models, the next-token cross-entropy (labels shifted, or ``shift_labels``
as given; -100 ignored) averaged over each sequence's counted tokens; for sequence
classification, the loss of the model's ``problem_type`` per sequence. Another head needs
``per_sample_loss=fn(outputs, inputs) -> [B]``, or is refused in one line.

Gradient accumulation (``gradient_accumulation_steps`` :math:`N`): each micro-batch's backward
adds :math:`s \nabla L_k`, :math:`s` the trainer's factor (:math:`1/N` where it divides the
loss by the steps, else 1) and :math:`L_k` its loss, normalized over the accumulated batch
(the micro-batches' losses sum to its loss :math:`L`: the model's loss divides by
``num_items_in_batch``, or ``loss_is_scaled_for_ga`` says so) or a mean over the micro-batch
(they sum to :math:`N L`), measured once where the trainer does not say (``_normalized``:
BERT's classification loss ignores ``num_items_in_batch``, while the trainer, seeing the model
accept it, does not divide). So the task's accumulated gradient is :math:`\sigma \nabla L`,
:math:`\sigma` = 1, or :math:`N` where the trainer sums micro-batch means, and every penalty
follows it: :math:`\sigma (L + \sum_k P_k)`.

A parameter penalty is that of :math:`\bar g = \nabla L`, taken in two phases
(``Window(N, normalized=...)``): each micro-batch's backward carries its :math:`\nabla L_k`;
the last one's also :math:`c\,\nabla^2 L\, v`, by the second phase over the window's
micro-batches (kept with their random states until then). A per-sample penalty with
``reduction="mean"`` is the mean over the accumulated batch (micro-batches of equal size), with
``"sum"`` the sum over it. The step equals :math:`\sigma` times that of one batch of the
accumulated size within float rounding, for models whose samples do
not interact (BatchNorm in training mode normalizes per micro-batch, as any accumulation does).

Refused in one line: points of a GAN (``real``, ``fake``...), a head without a known per-sample
loss, logits without a graph (a trainer whose loss is computed without them: TRL's
``SFTTrainer`` by a fused head), penalties at activations that run their own forward, and
under accumulation more than one parameter penalty or ``reduction="max"`` (a maximum over
micro-batches is not one over the batch). Evaluation (no grad, or the model in eval mode)
computes the loss alone.

On several processes (DDP: ``torchrun``, or ``accelerate launch``; ``args.world_size`` :math:`W
> 1`) a parameter penalty is that of the whole batch's gradient: the first phase ends with one
all-reduce of each rank's accumulated gradient (``Window(N, over_ranks=True)``), so the
penalty's value and direction :math:`v` are the batch's, the same on every rank; each rank's
second phase (its forwards run on the unwrapped model, past DDP's reducer) gives the Hessian
of its own share along :math:`v`, and DDP's mean of the ranks' gradients in the trainer's
backward completes :math:`\bar H v`. The ranks' shares are weighted as the trainer weights
them (by ``num_items_in_batch``, counted over all ranks, or equally). One parameter penalty
there. Each optimizer step begins with one all-gather of a few integers (which penalties are
due, how many micro-batches): ranks that disagree, e.g. a penalty due on one rank and not on
another (their ``due()`` counters apart), raise the same one-line error on every rank instead
of waiting in collectives that no longer match.

Under FSDP2 (``fsdp_config={"version": 2}``) a trainer whose one penalty is a finite
difference of the 2-norm along the gradient (``sam``, ``gr``, ``param_grad_norm(...,
method="finite_difference")``) on a model sharded whole takes it on each rank's shards
(:class:`~gradreg.penalties.shards.ShardedStep` over :class:`gradreg.sharding.ModuleShards`): the
trainer's backward of each micro-batch is the first pass (FSDP's reduce-scatter into the
sharded gradients), and after the step's last one a second pass of its micro-batches at the
shifted shards, the step's gradient left in the shards for the trainer's clipping and
optimizer; extra memory one of the rank's shards, and the reported loss is the task's (the
penalty in ``penalty_values`` after the step). For every other penalty the step's
micro-batches run holding the model's parameters gathered (a double backward needs them;
:class:`gradreg.sharding.HeldStep`), and FSDP's reduce-scatter, the mean over the ranks, runs
once after the last one's backward: during the step each rank holds the full parameters and
gradients (DDP's memory, not FSDP's share of it); the optimizer state and, between steps, the
parameters stay sharded.

Under DeepSpeed ZeRO-2 (``deepspeed={... "zero_optimization": {"stage": 2}}``) the parameter
penalties, by either method, are those of the whole batch's gradient as under DDP, on one
process or several. DeepSpeed hooks the outputs of its engine's forward: any backward through
them, ``torch.autograd.grad`` included, starts its backward and, when that graph ends, its
gradient reduction. So none of the penalty's passes goes through the trainer's forward: each
micro-batch's first phase runs a forward of its own on the unwrapped model (one forward and
backward more per micro-batch than under DDP), as the second phase does, and the trainer's
backward, DeepSpeed's, differentiates the trainer's loss, plus a zero carrying the penalty's
gradient :math:`c\,\bar H_r v` (the window's
:func:`~gradreg.integrations.engine_penalty.deepspeed_backward`); ZeRO's reduction averages the
ranks' sums as DDP's does. (DeepSpeed clips gradients to ``gradient_clipping``, 1.0 where a
configuration leaves it out and accelerate fills it; ``"auto"`` takes the trainer's
``max_grad_norm``.)

Under ZeRO-3, whose parameters are partitioned between forwards, the finite-difference penalties
(``sam``, ``gr``, ``param_grad_norm(..., method="finite_difference")``) run on each rank's
partitions (:class:`~gradreg.integrations.zero_sharded.ShardedStep`, the penalty alone due, the
2-norm, float32): the trainer's own backward of each micro-batch is the first pass; before the
engine's step (which accelerate's backward of the step's last micro-batch runs) a second pass of
the step's micro-batches through the engine at the shifted partitions, and the step's gradient
written into the engine's partitions; extra memory one of the rank's partitions, and the
reported loss is the task's (the penalty in ``penalty_values`` after the step). Otherwise (fp16,
an offloaded optimizer, another penalty due beside it, micro-batch means the trainer sums) the
shift is applied to each rank's partition (and to a parameter held gathered), so ZeRO-3's own
gathers compute at the shifted point
(:func:`gradreg.integrations.engine_penalty.zero3_shifted_parameters`), and the penalty's
gradient is handed to the parameters gathered whole.

Refused in one line when the trainer is built: under DeepSpeed the penalties at the inputs or
activations (their inner gradient through the engine's outputs would run its reduction); under
ZeRO-3 the exact parameter penalties (a double backward of partitioned parameters) and the
adaptive ones (ASAM reads the parameters whole); the parameter
penalties under FSDP1, FSDP2 on a torch before 2.6 and ``nn.DataParallel``. DDP and FSDP2
take them all.

``transformers`` (and ``accelerate``, which its ``Trainer`` needs) are the ``transformers``
extra; :class:`PenalizedTrainer` imports them on first use, and names the extra in one line
where one is missing. :class:`PenaltyMixin` itself imports nothing of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradreg import sharding
from gradreg.attention import differentiable_attention
from gradreg.autograd import GradientError, capture
from gradreg.extras import require
from gradreg.integrations.engine_penalty import check_zero3, deepspeed_backward
from gradreg.integrations.zero_sharded import ShardedStep as ZeroStep
from gradreg.integrations.zero_sharded import takes_sharded
from gradreg.penalties import (
    GeneratorState,
    GradientPenalty,
    StepForward,
    Window,
    penalty_terms,
)
from gradreg.penalties.accumulation import agreed_over_ranks
from gradreg.penalties.shards import ShardedStep, takes_shards
from gradreg.torch_compat import dtensor_type

__all__ = [  # noqa: F822 (PenalizedTrainer: built on use)
    "GR_TRL_EXCLUDED", "PenalizedTrainer", "PenaltyMixin", "excluding", "per_sample_losses"]

#: Where a trainer evaluates penalties (module docstring).
TRAINER_POINTS = ("inputs", "activations", "parameters")
IGNORE_INDEX = -100
PerSampleLoss = Callable[[Any, Mapping[str, Any]], Tensor]
ParameterFilter = Callable[[str, nn.Parameter], bool]
#: The name parts whose parameters gradientregularization_trl leaves out of its penalty by
#: default (embeddings, output layers and heads).
GR_TRL_EXCLUDED = ("embed", "embedding", "lm_head", "output", "classifier", "score")


def excluding(*parts: str) -> ParameterFilter:
    """A ``penalty_parameters`` selecting the parameters whose name contains none of
    ``parts`` (``excluding("embed", "lm_head")``)."""
    if not parts or not all(isinstance(part, str) and part for part in parts):
        raise GradientError(f"excluding takes non-empty name parts, got {parts!r}.")
    return lambda name, _parameter: not any(part in name for part in parts)


def _causal_lm_losses(logits: Tensor, inputs: Mapping[str, Any]) -> Tensor:
    r""":math:`\ell_i = \frac{1}{|T_i|}\sum_{t \in T_i} \mathrm{CE}(z_{i,t}, y_{i,t+1})`, the
    tokens :math:`T_i` of sequence :math:`i` whose label is not -100 (0 where none is)."""
    labels = inputs.get("shift_labels")
    if labels is None:
        logits, labels = logits[:, :-1], inputs["labels"][:, 1:]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    tokens = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none").view(labels.shape)
    return tokens.sum(1) / labels.ne(IGNORE_INDEX).sum(1).clamp(min=1)


def _classification_losses(logits: Tensor, labels: Tensor, config: Any) -> Tensor:
    """The loss of ``ForSequenceClassification`` models per sequence, by their ``problem_type``
    (inferred as they infer it: one label, regression; integer labels, single-label)."""
    problem = getattr(config, "problem_type", None) or (
        "regression" if config.num_labels == 1
        else "single_label_classification" if not labels.is_floating_point()
        else "multi_label_classification")
    if problem == "regression":
        return (logits.squeeze(-1) - labels).square().flatten(1).mean(1) if config.num_labels > 1 \
            else (logits.flatten() - labels.flatten()).square()
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, config.num_labels), labels.view(-1),
                               reduction="none")
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype),
                                              reduction="none").mean(-1)


def _head(model: nn.Module) -> str:
    """``"causal_lm"`` or ``"classification"`` for the model's class (transformers' auto
    mappings, as the trainer finds causal language models); a :class:`~gradreg.GradientError`
    naming ``per_sample_loss`` for another."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    for cls in type(model).__mro__:  # FSDP2 makes a subclass: FSDPGPT2LMHeadModel
        if cls.__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            return "causal_lm"
        if cls.__name__ in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values():
            return "classification"
    name = type(model).__name__
    raise GradientError(
        f"penalties of per-sample losses need each sample's loss, which gradreg computes for "
        f"causal language models and sequence classifiers, not {name}: pass "
        "per_sample_loss=fn(outputs, inputs) -> [batch] to the trainer.")


def per_sample_losses(model: nn.Module, outputs: Any, inputs: Mapping[str, Any]) -> Tensor:
    """The per-sample losses ``[B]`` of ``model``'s ``outputs`` (their ``logits``) on the batch
    ``inputs`` (its ``labels``) for a causal language model or a sequence classifier (module
    docstring); a :class:`~gradreg.GradientError` for another head."""
    logits = outputs["logits"]
    if _head(model) == "causal_lm":
        return _causal_lm_losses(logits, inputs)
    return _classification_losses(logits, inputs["labels"], model.config)


@contextmanager
def _embeddings_recorded(module: nn.Module) -> Iterator[list[Tensor]]:
    """Record the outputs of ``module`` (the input embeddings) in the block: each recorded tensor
    is the module's output as computed (made to require grad where the embeddings are frozen);
    the rest of the forward gets a copy (identity derivative), which in-place ops may change."""
    recorded: list[Tensor] = []

    def hook(_module: nn.Module, _args: Any, output: Tensor) -> Tensor:
        if not output.requires_grad:
            output.requires_grad_()
        recorded.append(output)
        return output.clone()

    handle = module.register_forward_hook(hook)
    try:
        yield recorded
    finally:
        handle.remove()


def _fsdp_version(trainer: Any) -> int:
    """The FSDP version of the trainer's ``fsdp_config`` (transformers' default: 2)."""
    return int((getattr(trainer.args, "fsdp_config", None) or {}).get("version", 2))


def _zero_stage(trainer: Any) -> int | None:
    """The ZeRO stage of the trainer's DeepSpeed engine; None where DeepSpeed is off."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    return int(trainer.accelerator.state.deepspeed_plugin.zero_stage)


@contextmanager
def _before_step(engine: Any, finish: Callable[[], None]) -> Iterator[None]:
    """In the block, ``finish()`` runs before each ``engine.step()`` (accelerate's backward of
    the step's last micro-batch runs the engine's backward and then its step)."""
    step, own = engine.step, "step" in vars(engine)

    def stepped(*args: Any, **kwargs: Any) -> Any:
        finish()
        return step(*args, **kwargs)

    engine.step = stepped
    try:
        yield
    finally:
        if own:
            engine.step = step
        else:
            del engine.step  # the engine's class's method again


class PenaltyMixin:
    """Adds ``penalties`` (name -> :class:`~gradreg.penalties.GradientPenalty`) to a
    ``transformers.Trainer`` subclass's training loss (module docstring).
    ``per_sample_loss``: ``fn(outputs, inputs) -> [B]`` for penalties of per-sample losses where
    the head is neither a causal language model nor a sequence classifier.
    ``penalty_parameters``: ``fn(name, parameter) -> bool``, the trainable parameters whose
    gradient the parameter penalties are of (and which they shift), by their names in the
    unwrapped model; all where not given. :func:`excluding` builds one from name parts
    (``excluding(*GR_TRL_EXCLUDED)``: gradientregularization_trl's default). The others take
    the task's gradient alone.
    ``penalty_values``: the detached weighted penalties of the latest step."""

    def __init__(self, *args: Any, penalties: Mapping[str, GradientPenalty] | None = None,
                 per_sample_loss: PerSampleLoss | None = None,
                 penalty_parameters: ParameterFilter | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.penalties = dict(penalties or {})
        self.per_sample_loss = per_sample_loss
        self.penalty_parameters = penalty_parameters
        self.penalty_values: dict[str, Tensor] = {}
        self._due: list[str] = []  # the penalties due in this optimizer step
        self._micro_batch = 0  # the micro-batches of this optimizer step so far
        self._step_window: Window | None = None  # its micro-batches and ranks (_window_of)
        self._loss_divides: bool | None = None  # measured once (_normalized)
        self._held: sharding.HeldStep | None = None  # an FSDP2 model's step (training_step)
        #: ZeRO-3's step on each rank's partitions, its penalty's name, and whether it keeps
        #: micro-batches of this optimizer step (_on_partitions)
        self._partitioned: tuple[str, ShardedStep] | None = None
        self._partitions_kept = False
        model = getattr(self, "model", None)
        for name, penalty in self.penalties.items():
            self._check(name, penalty, model)

    def _check(self, name: str, penalty: Any, model: nn.Module | None) -> None:
        """Refuse in one line a penalty the trainer cannot evaluate (module docstring)."""
        if not isinstance(penalty, GradientPenalty):
            raise GradientError(f"penalty {name!r} is a {type(penalty).__name__}, not a "
                                "gradreg GradientPenalty: build it with gradreg.penalties.")
        config = penalty.config
        if config.points not in TRAINER_POINTS:
            raise GradientError(
                f"penalty {name!r} has points={config.points!r}, which belong to a GAN: a "
                f"Trainer evaluates penalties at points {list(TRAINER_POINTS)} (the input "
                "embeddings, submodules' outputs, the parameters).")
        if config.points == "activations" and penalty.needs_callable:
            raise GradientError(
                f"penalty {name!r} (points='activations') asks for its own forward "
                f"(method={config.method.name!r}, subsample={config.subsample}, "
                f"chunks={config.chunks}), which a Trainer runs at the input embeddings only: "
                "use method='double_backward', subsample=1 and chunks=1.")
        if model is not None:
            self._check_fused_head(name, penalty, model)
        self._check_engine(name, penalty)
        args = getattr(self, "args", None)
        if not penalty.needs_callable and (getattr(args, "gradient_checkpointing", False)
                                           or getattr(args, "activation_checkpointing", False)):
            raise GradientError(
                f"penalty {name!r} (method={config.method.name!r}) differentiates the trainer's "
                "forward twice, and gradient checkpointing recomputes that forward in the "
                "backward with another attention kernel: set gradient_checkpointing=False, or "
                "use penalties on points='parameters' by finite difference: sam, asam, gr, or "
                "param_grad_norm(λ, method='finite_difference').")
        if model is None:
            return
        names = {n for n, _ in model.named_modules() if n}
        unknown = [layer for layer in config.layers if layer not in names]
        if unknown:
            raise GradientError(f"penalty {name!r} has layers={unknown}, not submodules of "
                                f"{type(model).__name__}: name them as model.named_modules() does.")
        if config.points != "parameters" and config.of == "loss" and self.per_sample_loss is None:
            _head(model)

    def _check_engine(self, name: str, penalty: GradientPenalty) -> None:
        """Refuse in one line, before training, a penalty the trainer's engine cannot take
        (module docstring): under DeepSpeed, those at points other than the parameters, and
        under ZeRO-3 the exact and the adaptive parameter penalties; the
        parameter penalties under FSDP1 and with several GPUs in one process
        (``nn.DataParallel``); DDP and FSDP2 take all."""
        parameters = penalty.config.points == "parameters"
        stage = _zero_stage(self)
        works = ("train with DDP (one process per device, e.g. torchrun) or FSDP2 "
                 "(fsdp_config={'version': 2}), which take every penalty of the whole batch")
        if stage == 3 and parameters:
            check_zero3(penalty, f"penalty {name!r}",
                        "FSDP2 (fsdp_config={'version': 2}), which takes it")
        if stage is not None and not parameters:
            taken = "sam, gr by finite difference" if stage == 3 else \
                "sam, asam, gr, param_grad_norm"
            raise GradientError(
                f"penalty {name!r} (points={penalty.config.points!r}) differentiates the "
                "trainer's forward twice, and DeepSpeed's backward hooks on the engine's outputs "
                "run its gradient reduction after the inner gradient: "
                f"{works}; or use a parameter penalty ({taken}), which DeepSpeed "
                f"ZeRO-{stage} takes.")
        engine = ("FSDP1" if parameters and getattr(self, "is_fsdp_enabled", False)
                  and _fsdp_version(self) != 2
                  else "FSDP2 on this torch" if parameters and getattr(self, "is_fsdp_enabled",
                                                                        False)
                  and not sharding.supports_exact_step()
                  else "nn.DataParallel" if parameters and getattr(getattr(self, "args", None),
                                                                    "n_gpu", 1) > 1
                  else None)
        if engine is not None:
            raise GradientError(
                f"penalty {name!r} (points={penalty.config.points!r}) is not taken under "
                f"{engine} yet: {works}.")

    def _check_fused_head(self, name: str, penalty: GradientPenalty, model: nn.Module) -> None:
        """Refuse in one line, before training, what TRL's fused LM head (a model whose forward
        takes ``fused_lm_head``: ``SFTTrainer``'s) cannot differentiate: the logits (it hands
        back those of a no-grad forward), and its loss twice (its chunked log-probability
        kernel has no double backward) unless the loss comes from the logits
        (``compute_loss_func``, or the label smoother with ``loss_type="nll"``)."""
        try:
            fused = "fused_lm_head" in inspect.signature(model.forward,
                                                         follow_wrapped=False).parameters
        except (TypeError, ValueError):  # a forward without a signature
            return
        if not fused:
            return
        config = penalty.config
        works = ("use penalties on points='parameters' by finite difference: sam, asam, gr, or "
                 "param_grad_norm(λ, method='finite_difference')")
        if config.points != "parameters":
            raise GradientError(
                f"penalty {name!r} (points={config.points!r}) differentiates the logits, which "
                f"{type(self).__name__} computes without a graph (TRL's fused LM head): {works}.")
        from_logits = self.compute_loss_func is not None or (
            self.label_smoother is not None and getattr(self.args, "loss_type", "nll") == "nll")
        if not penalty.needs_callable and not from_logits:
            raise GradientError(
                f"penalty {name!r} (method={config.method.name!r}) differentiates the loss "
                f"twice, and {type(self).__name__} computes it with TRL's fused LM head, whose "
                f"chunked log-probability kernel has no double backward: {works}; or pass "
                "compute_loss_func=... (the loss from the logits).")

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Tensor | int | None = None) -> Tensor:
        """The trainer's step; with penalties on an FSDP2 model, the step's micro-batches run
        holding its parameters gathered (``sharding.HeldStep``), and FSDP's reduction of the
        gradients runs once, after the last one's backward (module docstring)."""
        parent = super().training_step  # type: ignore[misc]
        if self.penalties and _zero_stage(self) == 3:
            with _before_step(self.accelerator.deepspeed_engine_wrapped.engine,
                              self._finish_partitions):
                return parent(model, inputs, num_items_in_batch)
        if self._on_fsdp_shards(model):  # the step's second pass after its last backward
            loss = parent(model, inputs, num_items_in_batch)
            if self._micro_batch == 0:
                self._finish_partitions()
            return loss
        if self._held is None and not (self.penalties and sharding.is_sharded(model)):
            return parent(model, inputs, num_items_in_batch)
        if self._held is None:
            self._held = sharding.HeldStep(model)
        try:
            loss = parent(model, inputs, num_items_in_batch)
            if self._micro_batch == 0:  # the optimizer step's last micro-batch
                self._held.reduce()
        except BaseException:
            self._held.release()
            self._held = None
            raise
        if self._micro_batch == 0:
            self._held.release()
            self._held = None
        return loss

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Tensor | int | None = None) -> Any:
        parent = super().compute_loss  # type: ignore[misc]
        if not self.penalties or not (model.training and torch.is_grad_enabled()):
            return parent(model, inputs, return_outputs=return_outputs,
                          num_items_in_batch=num_items_in_batch)
        count = getattr(self, "current_gradient_accumulation_steps", 1)
        if self._micro_batch == 0:  # due() once per optimizer step
            self._due = [name for name, gp in self.penalties.items() if gp.due()]
            self._agree(count)
        self._micro_batch = (self._micro_batch + 1) % count
        due = {name: self.penalties[name] for name in self._due}
        at_points = {n: gp for n, gp in due.items() if gp.config.points != "parameters"}
        layers = sorted({layer for gp in at_points.values() for layer in gp.config.layers})
        embeddings = any(gp.config.points == "inputs" for gp in at_points.values())
        state = GeneratorState.capture(*(v for v in inputs.values() if isinstance(v, Tensor)))
        with ExitStack() as stack:  # the trainer's forward, its graph differentiated again
            if any(not gp.needs_callable for gp in due.values()):
                stack.enter_context(differentiable_attention())
            embedded = stack.enter_context(_embeddings_recorded(
                self.accelerator.unwrap_model(model).get_input_embeddings())) if embeddings else []
            activations = stack.enter_context(capture(model, *layers)) if layers else {}
            # a copy each call: Trainer.compute_loss pops the labels where it computes the loss
            wanted = return_outputs or bool(at_points)  # TRL's SFTTrainer runs a forward more
            result = parent(model, dict(inputs), return_outputs=wanted,
                            num_items_in_batch=num_items_in_batch)
        loss, outputs = result if wanted else (result, None)
        share = self._share(num_items_in_batch, count)
        if self._on_partitions(due, model, inputs, loss, state, parent, num_items_in_batch,
                               count, share):
            return (loss, outputs) if return_outputs else loss
        forward = self._forward(model, inputs, loss, outputs, embedded, activations, state,
                                parent, num_items_in_batch, at_points)
        params, others = self._penalized_parameters(model) if len(at_points) < len(due) \
            else ([], [])
        window = self._window_of(count, model, inputs, num_items_in_batch)
        terms = penalty_terms(due, forward, params, others=others, window=window,
                              last=self._micro_batch == 0)
        self.penalty_values = {name: value.detach() for name, value in terms.penalties.items()}
        # the trainer multiplies the loss by s: a parameter penalty's value (its gradient is
        # carried by the task term) is reported once per step
        total = terms.task + sum(value / share if due[name].config.points == "parameters"
                                 else value for name, value in terms.penalties.items())
        return (total, outputs) if return_outputs else total

    def _on_fsdp_shards(self, model: nn.Module) -> bool:
        """Whether the trainer's one penalty runs on each rank's FSDP2 shards
        (:meth:`_on_partitions`): a finite difference of the 2-norm along the gradient
        (:func:`~gradreg.penalties.shards.takes_shards`) on a module ``fully_shard`` sharded
        whole (every trainable parameter a shard); its step is built here, between optimizer
        steps, where the parameters are the shards (a forward registers the gathered ones)."""
        if self._partitioned is not None:
            return isinstance(self._partitioned[1].shards, sharding.ModuleShards)
        if len(self.penalties) != 1 or not sharding.is_sharded(model):
            return False
        ((name, penalty),) = self.penalties.items()
        if penalty.config.points != "parameters" or not takes_shards(penalty):
            return False
        params, others = self._penalized_parameters(model)
        sharded = dtensor_type()
        if not all(isinstance(p, sharded) for p in params + others):
            return False
        self._partitioned = (name, sharding.ShardedPenalty(model, penalty, params).step)
        return True

    def _on_partitions(self, due: Mapping[str, GradientPenalty], model: nn.Module,
                       inputs: dict[str, Any], loss: Tensor, state: GeneratorState,
                       parent: Callable[..., Tensor], num_items_in_batch: Tensor | int | None,
                       count: int, share: float) -> bool:
        r"""Under ZeRO-3 and FSDP2, keep the micro-batch for the penalty's step on each rank's
        shards (:class:`~gradreg.penalties.shards.ShardedStep`; the trainer's backward is the
        first pass, :meth:`_finish_partitions` the second, before the optimizer's step) where
        it takes the one due penalty and the accumulated gradient is :math:`\nabla L` (the
        trainer's micro-batch losses normalized over the step's batch, or means it divides by
        their number); False otherwise (ZeRO-3: the window's way)."""
        stage = _zero_stage(self)
        fsdp = self._partitioned is not None and isinstance(self._partitioned[1].shards,
                                                             sharding.ModuleShards)
        if (stage != 3 and not fsdp) or len(due) != 1:
            return False
        ((name, gp),) = due.items()
        if gp.config.points != "parameters" or (stage == 3 and not takes_sharded(model, gp)):
            return False
        if count > 1 and share == 1.0 and not self._normalized(model, inputs, num_items_in_batch):
            if fsdp:  # σ = N: the step would be the penalty of N ∇L
                raise GradientError(
                    f"penalty {name!r} on FSDP2's shards takes the gradient the trainer "
                    "accumulates as the step's, and this trainer sums its micro-batches' mean "
                    "losses (its loss ignores num_items_in_batch, which the trainer takes as "
                    "normalized): set trainer.loss_is_scaled_for_ga = False (the trainer then "
                    "divides each micro-batch's loss by their number).")
            return False
        if self._partitioned is None or self._partitioned[0] != name:
            self._partitioned = (name, ZeroStep(model, gp, self._penalized_parameters(model)[0]))
        # the trainer's backward is of s L_k; DeepSpeed's divides by its steps
        scale = share * (model.gradient_accumulation_steps() if stage == 3 else 1)

        def loss_of(target: nn.Module) -> Tensor:
            return parent(target, dict(inputs), num_items_in_batch=num_items_in_batch) * scale

        self._partitioned[1].add(loss_of, state, loss)
        self._partitions_kept = True
        return True

    def _finish_partitions(self) -> None:
        """The second pass of ZeRO-3's step on the partitions, where micro-batches are kept
        (:meth:`_on_partitions`): the step's gradient in the engine's partitions."""
        if self._partitions_kept:
            self._partitions_kept = False
            name, step = self._partitioned
            self.penalty_values = {name: step.finish()}

    def _window_of(self, count: int, model: nn.Module, inputs: Mapping[str, Any],
                   num_items_in_batch: Tensor | int | None) -> Window | None:
        r"""The step's :class:`~gradreg.penalties.Window`, kept from step to step (its first
        phases): ``count`` micro-batches, over the ranks on several processes, normalized where
        the trainer's micro-batch losses are (``_normalized``), DeepSpeed's own backward
        (``deepspeed_backward``); None where the step's batch is not divided."""
        stage = _zero_stage(self)
        window = Window(count, over_ranks=self.args.world_size > 1,
                        normalized=count > 1 and self._normalized(model, inputs,
                                                                  num_items_in_batch),
                        engine=None if stage is None else deepspeed_backward(stage))
        kept = self._step_window
        if kept is None or (kept.size, kept.over_ranks, kept.normalized, kept.engine) != (
                window.size, window.over_ranks, window.normalized, window.engine):
            self._step_window = kept = window
        return kept if kept.divided else None

    def _agree(self, count: int) -> None:
        """On several processes, refuse in one line on every rank a step whose penalties are
        due on some ranks and not on others, or whose ranks accumulate different numbers of
        micro-batches (module docstring): one all-gather of a few integers per optimizer step,
        before any collective of the penalties, which would otherwise mismatch (a hang)."""
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            agreed_over_ranks({f"penalty {name!r} due": int(name in self._due)
                               for name in self.penalties}
                              | {"micro-batches in the step": count},
                              f"{type(self).__name__} on {self.args.world_size} processes")

    def _share(self, num_items_in_batch: Tensor | int | None, count: int) -> float:
        r""":math:`s`, the factor ``training_step`` applies to the loss before its backward:
        :math:`1/N` where the loss is a micro-batch's mean, 1 where the loss was normalized over
        the accumulated batch (``num_items_in_batch`` given to the model, or
        ``compute_loss_func``), as ``transformers.Trainer.training_step`` decides."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = ((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                      or self.compute_loss_func is not None)
        return 1.0 if scaled else 1.0 / count

    def _normalized(self, model: nn.Module, inputs: Mapping[str, Any],
                    num_items_in_batch: Tensor | int | None) -> bool:
        r"""Whether the trainer's micro-batch losses :math:`L_k` are normalized over the
        accumulated batch (they sum to its loss :math:`L`), rather than each a mean over its
        micro-batch (they sum to :math:`N L`): ``loss_is_scaled_for_ga`` where the trainer sets
        it; else, where ``num_items_in_batch`` is given, whether the loss divides by it (the
        model's own loss, or ``compute_loss_func``'s: measured once, by two no-grad forwards in
        eval mode at ``num_items_in_batch`` and twice it; BERT's sequence-classification loss,
        for one, ignores it while the trainer takes it as normalized); a micro-batch's mean
        where it is not given."""
        declared = getattr(self, "loss_is_scaled_for_ga", None)
        if declared is not None:
            return bool(declared)
        if num_items_in_batch is None:
            return False
        if self._loss_divides is None:
            self._loss_divides = self._divides(model, inputs, num_items_in_batch)
        return self._loss_divides

    def _divides(self, model: nn.Module, inputs: Mapping[str, Any],
                 num_items_in_batch: Tensor | int) -> bool:
        """Whether the trainer's loss of ``inputs`` halves when ``num_items_in_batch`` doubles
        (``_normalized``); a :class:`~gradreg.GradientError` where it does neither."""
        if self.compute_loss_func is None and self.label_smoother is not None:
            return True  # transformers' LabelSmoother divides by num_items_in_batch
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                if self.compute_loss_func is None:
                    def loss(n: Tensor | int) -> Tensor:
                        return model(**inputs, num_items_in_batch=n)["loss"]
                else:
                    outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})

                    def loss(n: Tensor | int) -> Tensor:
                        return self.compute_loss_func(outputs, inputs.get("labels"),
                                                      num_items_in_batch=n)
                once, twice = (float(loss(n)) for n in (num_items_in_batch, 2 * num_items_in_batch))
        finally:
            model.train(training)
        if once == twice:
            return False
        if abs(once - 2 * twice) <= 1e-3 * abs(once):
            return True
        raise GradientError(
            f"the trainer's loss neither divides by num_items_in_batch nor ignores it ({once:.6g} "
            f"at {int(num_items_in_batch)}, {twice:.6g} at twice it), so the scale of its "
            "accumulated micro-batches is unknown: set trainer.loss_is_scaled_for_ga (True: "
            "normalized over the accumulated batch; False: a mean over the micro-batch).")

    def _losses(self, model: nn.Module, outputs: Any, inputs: Mapping[str, Any]) -> Tensor:
        if self.per_sample_loss is not None:
            return self.per_sample_loss(outputs, inputs)
        return per_sample_losses(self.accelerator.unwrap_model(model), outputs, inputs)

    def _forward(self, model: nn.Module, inputs: dict[str, Any], loss: Tensor, outputs: Any,
                 embedded: list[Tensor], activations: Mapping[str, Tensor],
                 state: GeneratorState, parent: Callable[..., Tensor],
                 num_items_in_batch: Tensor | int | None,
                 at_points: Mapping[str, GradientPenalty]) -> StepForward:
        """The trainer's forward as :func:`~gradreg.penalties.penalty_terms` takes it: the
        points the input embeddings, the forward at other points the model called with
        ``inputs_embeds`` (the batch's other per-sample tensors passed along), the loss again
        the trainer's own loss, on the unwrapped model (past DDP's reducer and DeepSpeed's
        hooks, which the trainer's backward feeds)."""
        again_on = self.accelerator.unwrap_model(model) \
            if self.args.world_size > 1 or _zero_stage(self) is not None else model

        def again() -> Tensor:
            return parent(again_on, dict(inputs), num_items_in_batch=num_items_in_batch)

        logits = None if outputs is None else outputs["logits"]
        if at_points and not logits.requires_grad:
            raise GradientError(
                f"{type(self).__name__}.compute_loss returned logits without a graph (its loss "
                "is computed without them, e.g. by a fused head): penalties at the embeddings "
                "or activations differentiate the logits; use a trainer whose model returns "
                "them, or penalties on points='parameters'.")
        if any(gp.config.points == "inputs" for gp in at_points.values()) and len(embedded) != 1:
            raise GradientError(
                f"the input embeddings ran {len(embedded)} times in one forward: a penalty at "
                "the embeddings needs the one tensor the model computed from the batch.")
        points = embedded[0] if embedded else None
        keys = [] if points is None else [
            k for k, v in inputs.items() if k != "input_ids" and isinstance(v, Tensor)
            and v.ndim > 0 and v.shape[0] == points.shape[0]]
        fixed = {k: v for k, v in inputs.items() if k != "input_ids" and k not in keys}

        def at_embeddings(of_loss: bool) -> Callable[..., Tensor]:
            def forward(embeds: Tensor, *args: Tensor) -> Tensor:
                batch = {**fixed, **dict(zip(keys, args, strict=True))}
                result = model(inputs_embeds=embeds, **{
                    k: v for k, v in batch.items() if k not in ("labels", "shift_labels")})
                return self._losses(model, result, batch) if of_loss else result["logits"]

            return forward

        return StepForward(loss, logits, lambda: self._losses(model, outputs, inputs), state,
                           again, points=points, outputs_at=at_embeddings(False),
                           losses_at=at_embeddings(True),
                           point_args=tuple(inputs[k] for k in keys), activations=activations)

    def _penalized_parameters(self, model: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
        """The trainable parameters ``penalty_parameters`` selects (all where not given), and
        the others, which take the task's gradient alone."""
        chosen = self.penalty_parameters
        named = [(n, p) for n, p in self.accelerator.unwrap_model(model).named_parameters()
                 if p.requires_grad]
        params = [p for n, p in named if chosen is None or chosen(n, p)]
        if not params:
            raise GradientError(
                "penalty_parameters selects none of the model's trainable parameters: select "
                "some by their names in model.named_parameters().")
        selected = set(map(id, params))
        return params, [p for _, p in named if id(p) not in selected]


def __getattr__(name: str) -> type:
    if name != "PenalizedTrainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require("transformers", "gradreg.integrations.hf_trainer.PenalizedTrainer", "transformers",
            "accelerate")
    from transformers import Trainer

    trainer = type("PenalizedTrainer", (PenaltyMixin, Trainer), {
        "__module__": __name__,
        "__doc__": "``transformers.Trainer`` with :class:`PenaltyMixin`: pass ``penalties=``."})
    globals()[name] = trainer
    return trainer
