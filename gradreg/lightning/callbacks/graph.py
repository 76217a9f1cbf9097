"""Log, once, the autograd graph of the penalized loss: a picture, text and Graphviz DOT.

A gradient penalty is a function of a gradient built with ``create_graph=True``, so the loss's
backward graph contains the graph *of that gradient* (the double-backward nodes) besides the
forward graph. The graph is read in ``on_before_backward``, where Lightning hands over the loss
before its backward frees the saved tensors; walking ``grad_fn.next_functions`` needs no saved
tensor anyway (:func:`gradreg.graph.walk_backward_graph`).

Which nodes are double-backward: during the training batch whose loss is drawn, autograd's
anomaly mode is on (without its NaN check), and in anomaly mode every node created while a
backward runs records the node being differentiated
(:func:`gradreg.torch_compat.created_by_a_backward`, pinned by its tests). Those are exactly the
nodes of the gradient's graph. Anomaly mode costs a stack trace per node, on that one batch only.

Tags: the image ``graph/autograd`` (leaves labelled with the module's parameter names,
double-backward nodes in orange) and the text ``autograd_graph/text`` and ``autograd_graph/dot``
(Text tab, to search and to paste into Graphviz). TensorBoard's Graphs tab draws TorchScript
traces of a forward pass (``add_graph``), which has no notion of a gradient's graph, so the
graph is not logged there.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from gradreg import autograd_graph
from gradreg.graph import walk_backward_graph
from gradreg.lightning.callbacks._logging import (
    logging_step,
    tensorboard,
    warn_without_tensorboard,
)
from gradreg.lightning.callbacks.graph_figure import graph_figure
from gradreg.lightning.dashboards import AUTOGRAD_GRAPH, GRAPH_PICTURE
from gradreg.torch_compat import created_by_a_backward


def _code_block(text: str) -> str:
    """Markdown code block (TensorBoard renders text summaries as Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def node_kinds(loss: Tensor, parameters: dict[int, str]) -> tuple[list[str], list[str],
                                                                    dict[int, str], list[Any]]:
    """The backward graph of ``loss``: node names, kinds (of ``graph_figure.KINDS``), labels of
    the leaves (``parameters``: ``id(tensor) -> name``; other leaves by shape) and edges."""
    walked = walk_backward_graph([loss])
    names, kinds, labels = [], [], {}
    for index, node in enumerate(walked.nodes):
        names.append(type(node).__name__)
        variable = getattr(node, "variable", None)
        if variable is not None:
            named = parameters.get(id(variable))
            kinds.append("parameter" if named else "leaf")
            labels[index] = named or f"leaf {list(variable.shape)}"
        elif created_by_a_backward(node):
            kinds.append("double_backward")
        else:
            kinds.append("forward")
    return names, kinds, labels, walked.edges


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
        self._anomaly: tuple[bool, bool] | None = None  # the modes to restore

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "AutogradGraphLogger", "the autograd graph")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.logged or tensorboard(trainer) is None or trainer.global_step < self.at_step:
            return
        self._anomaly = torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()
        torch.set_anomaly_enabled(True, False)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._restore_anomaly_mode()

    def _restore_anomaly_mode(self) -> None:
        if self._anomaly is not None:
            torch.set_anomaly_enabled(*self._anomaly)
            self._anomaly = None

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor
    ) -> None:
        writer = tensorboard(trainer)
        if self.logged or writer is None or trainer.global_step < self.at_step:
            return
        step = logging_step(trainer)
        parameters = {id(param): name for name, param in pl_module.named_parameters()}
        names, kinds, labels, edges = node_kinds(loss, parameters)
        title = (f"backward graph of the loss, step {step}: {len(names)} nodes,\n"
                 f"{kinds.count('double_backward')} of them double backward")
        writer.add_figure(GRAPH_PICTURE, graph_figure(names, kinds, edges, labels, title),
                          step, close=True)
        graph = autograd_graph(loss)
        writer.add_text(f"{AUTOGRAD_GRAPH}/text", _code_block(graph.to_text()), step)
        writer.add_text(f"{AUTOGRAD_GRAPH}/dot", _code_block(graph.to_dot()), step)
        self.logged = True
        self._restore_anomaly_mode()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_anomaly_mode()
        if not self.logged and tensorboard(trainer) is not None:
            rank_zero_warn(
                f"AutogradGraphLogger saw no backward at or after step {self.at_step}: return the "
                "loss from training_step or call self.manual_backward(loss) instead of "
                "loss.backward(), and check at_step against the number of steps."
            )
