"""Log, once, the autograd graph of the penalized loss as text and Graphviz DOT in TensorBoard.

A gradient penalty is a function of a gradient built with ``create_graph=True``, so the loss's
backward graph contains the graph *of that gradient* (the double-backward nodes) besides the
forward graph. The graph is read in ``on_before_backward``, where Lightning hands over the loss
before its backward frees the saved tensors; walking ``grad_fn.next_functions`` needs no saved
tensor anyway (:func:`gradreg.autograd_graph`). Tags: ``autograd_graph/text`` and
``autograd_graph/dot`` (TensorBoard's Text tab).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from gradreg import autograd_graph
from gradreg.lightning.callbacks._logging import (
    logging_step,
    tensorboard,
    warn_without_tensorboard,
)
from gradreg.lightning.dashboards import AUTOGRAD_GRAPH


def _code_block(text: str) -> str:
    """Markdown code block (TensorBoard renders text summaries as Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


class AutogradGraphLogger(pl.Callback):
    """Log the backward graph of the first loss backpropagated at or after step ``at_step``.

    The loss must go through Lightning's backward: returned from ``training_step`` (automatic
    optimization) or passed to ``self.manual_backward`` (manual); a bare ``loss.backward()`` is
    not seen. Pick ``at_step`` so that the penalty is computed on that step (lazy penalties).
    """

    def __init__(self, at_step: int = 0) -> None:
        if not isinstance(at_step, int) or at_step < 0:
            raise ValueError(f"at_step must be an int >= 0 (an optimizer step), got {at_step!r}.")
        self.at_step = at_step
        self.logged = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "AutogradGraphLogger", "the autograd graph")

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor
    ) -> None:
        writer = tensorboard(trainer)
        if self.logged or writer is None or trainer.global_step < self.at_step:
            return
        graph = autograd_graph(loss)
        step = logging_step(trainer)
        writer.add_text(f"{AUTOGRAD_GRAPH}/text", _code_block(graph.to_text()), step)
        writer.add_text(f"{AUTOGRAD_GRAPH}/dot", _code_block(graph.to_dot()), step)
        self.logged = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.logged and tensorboard(trainer) is not None:
            rank_zero_warn(
                f"AutogradGraphLogger saw no backward at or after step {self.at_step}: return the "
                "loss from training_step or call self.manual_backward(loss) instead of "
                "loss.backward(), and check at_step against the number of steps."
            )
