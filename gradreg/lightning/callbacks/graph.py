"""Log the autograd graphs of the penalized loss, each distinct one once: a picture, text and
Graphviz DOT.

A gradient penalty is a function of a gradient built with ``create_graph=True``, so the loss's
backward graph contains the graph *of that gradient* (the double-backward nodes) besides the
forward graph. The graph is read in ``on_before_backward``, where Lightning hands over the loss
before its backward frees the saved tensors; walking ``grad_fn.next_functions`` needs no saved
tensor anyway (:func:`gradreg.graph.walk_backward_graph`).

Which nodes are double-backward: during the training batches whose losses are drawn, autograd's
anomaly mode is on (without its NaN check), and in anomaly mode every node created while a
backward runs records the node being differentiated
(:func:`gradreg.torch_compat.created_by_a_backward`, pinned by its tests). Those are exactly the
nodes of the gradient's graph (:func:`gradreg.autograd_graph` reads the mark). Anomaly mode costs a
stack trace per node, on the watched batches only.

Tags: the image ``graph/autograd`` (each module call one box, ``fc1 (Linear)``, holding its op,
its parameters and their views: :func:`gradreg.graph.collapse_module_calls`; double-backward
nodes in orange; sized to be read at TensorBoard's card size) and the text
``autograd_graph/text`` and ``autograd_graph/dot`` (Text tab, to search and to paste into
Graphviz: the full graph, every node, with the same parameter names and double-backward
marks), once per distinct graph of the watched batches. With several optimizers (a GAN) each
network's picture has its own tag, ``graph/autograd/<owner>`` (``<owner>``: the submodule whose
parameters the graph reaches, ``critic`` or ``generator``); their texts share the text tags, and
name the parameters.
TensorBoard's Graphs tab draws TorchScript traces of a forward pass (``add_graph``), which has
no notion of a gradient's graph, so the graph is not logged there.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from gradreg.graph import AutogradGraph, autograd_graph, collapse_module_calls
from gradreg.lightning.callbacks._logging import (
    logging_step,
    tensorboard,
    warn_without_tensorboard,
)
from gradreg.lightning.callbacks.graph_figure import graph_figure
from gradreg.lightning.dashboards.tags import AUTOGRAD_GRAPH, GRAPH_PICTURE


def _code_block(text: str) -> str:
    """Markdown code block (TensorBoard renders text summaries as Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def node_kinds(graph: AutogradGraph) -> tuple[list[str], list[str], dict[int, str]]:
    """The nodes of ``graph`` for the picture: names, kinds (of ``graph_figure.KINDS``) and the
    labels of the leaves (a parameter's name; other leaves by shape)."""
    names, kinds, labels = [], [], {}
    for node in graph.nodes:
        names.append(node.name)
        if node.is_leaf:
            kinds.append("parameter" if node.label else "leaf")
            labels[node.index] = node.label or f"leaf {list(node.leaf_shape or ())}"
        else:
            kinds.append("double_backward" if node.double_backward else "forward")
    return names, kinds, labels


def _owner(graph: AutogradGraph) -> str:
    """The submodules whose parameters are the graph's parameter leaves, joined by ``+`` (a GAN
    phase's network: ``critic`` or ``generator``)."""
    return "+".join(sorted({node.label.split(".", 1)[0] for node in graph.nodes
                            if node.label})) or "no_parameters"


class AutogradGraphLogger(pl.Callback):
    """Log the backward graphs of the losses backpropagated in ``batches`` training batches
    from step ``at_step`` on, each distinct graph once.

    The loss must go through Lightning's backward: returned from ``training_step`` (automatic
    optimization) or passed to ``self.manual_backward`` (manual); a bare ``loss.backward()`` is
    not seen. Pick ``at_step`` so that the penalty is computed on that step (lazy penalties),
    and ``batches`` so that every kind of step is seen (a GAN's generator step comes after
    ``n_critic`` critic batches); a graph equal to one already logged (same nodes, kinds, leaves
    and edges) is not logged again, so the images are one per distinct graph.
    """

    def __init__(self, at_step: int = 0, batches: int = 1) -> None:
        if not isinstance(at_step, int) or at_step < 0:
            raise ValueError(f"at_step must be an int >= 0 (an optimizer step), got {at_step!r}.")
        if not isinstance(batches, int) or batches < 1:
            raise ValueError(f"batches must be an int >= 1 (training batches to watch), got "
                             f"{batches!r}.")
        self.at_step = at_step
        self.batches = batches
        self.watched = 0
        self.logged: list[tuple] = []  # the signature of each graph logged
        self._anomaly: tuple[bool, bool] | None = None  # the modes to restore

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_without_tensorboard(trainer, "AutogradGraphLogger", "the autograd graph")

    def _watching(self, trainer: pl.Trainer) -> bool:
        return (tensorboard(trainer) is not None and trainer.global_step >= self.at_step
                and self.watched < self.batches)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if not self._watching(trainer):
            return
        self._anomaly = torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()
        torch.set_anomaly_enabled(True, False)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._anomaly is not None:
            self.watched += 1
        self._restore_anomaly_mode()

    def _restore_anomaly_mode(self) -> None:
        if self._anomaly is not None:
            torch.set_anomaly_enabled(*self._anomaly)
            self._anomaly = None

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor
    ) -> None:
        if self._anomaly is None:  # not a watched batch
            return
        writer = tensorboard(trainer)
        graph = autograd_graph(loss, dict(pl_module.named_parameters()))
        names, kinds, labels = node_kinds(graph)
        signature = (tuple(names), tuple(kinds), tuple(sorted(labels.items())),
                     tuple(graph.edges))
        if signature in self.logged:
            return
        step = logging_step(trainer)
        owner = _owner(graph) if len(trainer.optimizers) > 1 else None
        of = f"the {owner}'s loss" if owner else "the loss"
        boxes = collapse_module_calls(graph, {name: type(module).__name__ for name, module
                                              in pl_module.named_modules()})
        title = (f"backward graph of {of}, step {step}:\n{len(names)} nodes "
                 f"({kinds.count('double_backward')} double backward) in "
                 f"{len(boxes.labels)} boxes")
        picture = f"{GRAPH_PICTURE}/{owner}" if owner else GRAPH_PICTURE
        figure = graph_figure(boxes.labels, boxes.kinds, boxes.edges, title=title)
        writer.add_figure(picture, figure, step, close=True)
        writer.add_text(f"{AUTOGRAD_GRAPH}/text", _code_block(graph.to_text()), step)
        writer.add_text(f"{AUTOGRAD_GRAPH}/dot", _code_block(graph.to_dot()), step)
        self.logged.append(signature)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_anomaly_mode()
        if not self.logged and tensorboard(trainer) is not None:
            rank_zero_warn(
                f"AutogradGraphLogger saw no backward at or after step {self.at_step}: return the "
                "loss from training_step or call self.manual_backward(loss) instead of "
                "loss.backward(), and check at_step against the number of steps."
            )
