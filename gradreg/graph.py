"""The autograd graph behind a tensor, walked through ``grad_fn.next_functions``.

Each node of the backward graph is a ``grad_fn`` object (``MulBackward0``, ``ExpBackward0``, ...)
whose ``next_functions`` is a tuple of ``(node, input_nr)`` pairs: the nodes that receive its
output gradients, and which output of those nodes' forward op fed it. Leaves that require grad
end in ``AccumulateGrad`` nodes holding the leaf in ``.variable``. The same walk works on the graph
of a gradient built with ``create_graph=True``, which links back into the forward graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

__all__ = ["AutogradGraph", "GraphEdge", "GraphNode", "autograd_graph"]


@dataclass(frozen=True)
class GraphNode:
    """One backward node: ``name`` is the grad_fn class (``AccumulateGrad`` for leaves)."""

    index: int
    name: str
    is_leaf: bool
    leaf_shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class GraphEdge:
    """Gradient flows from ``source`` to ``target``.

    ``slot`` is the position in ``source.next_functions``, i.e. which input of the source's forward
    op; ``input_nr`` is the pair's second element, i.e. which output of the target's forward op
    produced that input (0 for leaves).
    """

    source: int
    target: int
    input_nr: int
    slot: int


@dataclass
class AutogradGraph:
    """Nodes and edges of a backward graph, numbered in discovery order from the root (node 0)."""

    nodes: list[GraphNode] = field(default_factory=list)
    edges: list[GraphEdge] = field(default_factory=list)

    def names(self) -> list[str]:
        return [node.name for node in self.nodes]

    def successors(self, index: int) -> list[GraphNode]:
        """Nodes that ``nodes[index]`` passes gradients to, in ``next_functions`` order."""
        return [self.nodes[e.target] for e in sorted(self.edges, key=lambda e: e.slot)
                if e.source == index]

    def _label(self, node: GraphNode) -> str:
        if node.leaf_shape is None:
            return node.name
        return f"{node.name} (leaf {list(node.leaf_shape)})"

    def to_text(self) -> str:
        """One line per node: ``[i] Name -> [j] Name (input k), ...``."""
        lines = []
        for node in self.nodes:
            targets = ", ".join(
                f"[{e.target}] {self.nodes[e.target].name} (input {e.input_nr})"
                for e in self.edges
                if e.source == node.index
            )
            arrow = f" -> {targets}" if targets else ""
            lines.append(f"[{node.index}] {self._label(node)}{arrow}")
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz DOT source; leaves are drawn as boxes."""
        lines = ["digraph autograd {", "  rankdir=BT;"]
        for node in self.nodes:
            shape = "box" if node.is_leaf else "ellipse"
            lines.append(f'  n{node.index} [label="{self._label(node)}", shape={shape}];')
        lines.extend(
            f'  n{e.source} -> n{e.target} [label="{e.input_nr}"];' for e in self.edges
        )
        lines.append("}")
        return "\n".join(lines)


def autograd_graph(tensor: Tensor) -> AutogradGraph:
    """Walk ``tensor.grad_fn`` and every ``next_functions`` reachable from it (each node once)."""
    if tensor.grad_fn is None:
        raise ValueError(
            "the tensor has no grad_fn: it is a leaf or was computed without grad, so it has no "
            "backward graph. Pass a tensor computed from inputs that require grad."
        )
    graph = AutogradGraph()
    index_of: dict[int, int] = {}
    keep_alive = []  # ids are only unique while the objects live

    def visit(fn: object) -> int:
        key = id(fn)
        if key in index_of:
            return index_of[key]
        keep_alive.append(fn)
        variable = getattr(fn, "variable", None)
        node = GraphNode(
            index=len(graph.nodes),
            name=type(fn).__name__,
            is_leaf=variable is not None,
            leaf_shape=None if variable is None else tuple(variable.shape),
        )
        index_of[key] = node.index
        graph.nodes.append(node)
        return node.index

    stack = [tensor.grad_fn]
    visit(tensor.grad_fn)
    expanded: set[int] = set()
    while stack:
        fn = stack.pop(0)
        source = index_of[id(fn)]
        if source in expanded:
            continue
        expanded.add(source)
        for slot, (child, input_nr) in enumerate(fn.next_functions):
            if child is None:
                continue
            target = visit(child)
            graph.edges.append(GraphEdge(source, target, input_nr, slot))
            stack.append(child)
    return graph
