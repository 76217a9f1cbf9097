"""The autograd graph behind a tensor, walked through ``grad_fn.next_functions``.

Each node of the backward graph is a ``grad_fn`` object (``MulBackward0``, ``ExpBackward0``, ...)
whose ``next_functions`` is a tuple of ``(node, input_nr)`` pairs: the nodes that receive its
output gradients, and which output of those nodes' forward op fed it. Leaves that require grad
end in ``AccumulateGrad`` nodes holding the leaf in ``.variable``. The same walk works on the graph
of a gradient built with ``create_graph=True``, which links back into the forward graph.

There is one walk, :func:`walk_backward_graph`; everything else (the rendered graph, the node
names, the leaves) is read off its result. It tells nodes apart by the identity of their Python
wrappers and therefore keeps every wrapper it has met alive until it returns: torch creates a
wrapper on demand and, on some versions (2.11), frees it as soon as no Python reference is left,
so a later wrapper can reuse the address and an ``id()`` of a dropped wrapper would make unvisited
nodes look seen (the walk then stops after a couple of nodes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from torch import Tensor

from gradreg.torch_compat import created_by_a_backward

__all__ = [
    "AutogradGraph",
    "BackwardGraph",
    "CollapsedGraph",
    "GraphEdge",
    "GraphNode",
    "autograd_graph",
    "collapse_module_calls",
    "graph_leaves",
    "graph_node_names",
    "walk_backward_graph",
]


@dataclass(frozen=True)
class GraphNode:
    """One backward node: ``name`` is the grad_fn class (``AccumulateGrad`` for leaves);
    ``label`` a leaf's parameter name, where one was given; ``double_backward``: the node was
    created while a backward ran (the graph of a gradient built with ``create_graph=True``),
    known only for nodes created under anomaly mode."""

    index: int
    name: str
    is_leaf: bool
    leaf_shape: tuple[int, ...] | None = None
    label: str | None = None
    double_backward: bool = False


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
            return f"{node.name} [double backward]" if node.double_backward else node.name
        what = node.label or "leaf"
        return f"{node.name} ({what} {list(node.leaf_shape)})"

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
        """Graphviz DOT source; leaves are drawn as boxes (named parameters filled green),
        double-backward nodes filled orange."""
        lines = ["digraph autograd {", "  rankdir=BT;"]
        for node in self.nodes:
            shape = "box" if node.is_leaf else "ellipse"
            fill = ("#b6d7a8" if node.label else None) if node.is_leaf else (
                "#f9b872" if node.double_backward else None)
            style = f', style=filled, fillcolor="{fill}"' if fill else ""
            lines.append(f'  n{node.index} [label="{self._label(node)}", shape={shape}{style}];')
        lines.extend(
            f'  n{e.source} -> n{e.target} [label="{e.input_nr}"];' for e in self.edges
        )
        lines.append("}")
        return "\n".join(lines)


@dataclass
class BackwardGraph:
    """What :func:`walk_backward_graph` found: the ``grad_fn`` objects themselves, in
    breadth-first discovery order, and the edges between their positions in ``nodes``."""

    nodes: list[object]
    edges: list[GraphEdge]

    def names(self) -> set[str]:
        return {type(node).__name__ for node in self.nodes}

    def leaves(self) -> list[Tensor]:
        """The tensors of the ``AccumulateGrad`` nodes: the leaves requiring grad."""
        return [node.variable for node in self.nodes if hasattr(node, "variable")]


def walk_backward_graph(roots: Iterable[Tensor]) -> BackwardGraph:
    """Every backward node reachable from the roots' ``grad_fn`` through ``next_functions``, each
    once, breadth first; iterative, so a graph of any depth is walked. Roots without a graph
    (leaves, tensors computed without grad) contribute nothing."""
    nodes: list[object] = []
    index_of: dict[int, int] = {}  # id(wrapper) -> position; ``nodes`` keeps the wrappers alive
    edges: list[GraphEdge] = []

    def visit(fn: object) -> int:
        if id(fn) not in index_of:
            index_of[id(fn)] = len(nodes)
            nodes.append(fn)
        return index_of[id(fn)]

    for root in roots:
        if root.grad_fn is not None:
            visit(root.grad_fn)
    expanded = 0
    while expanded < len(nodes):  # ``nodes`` doubles as the breadth-first queue
        source, fn = expanded, nodes[expanded]
        expanded += 1
        for slot, (child, input_nr) in enumerate(fn.next_functions):
            if child is not None:
                edges.append(GraphEdge(source, visit(child), input_nr, slot))
    return BackwardGraph(nodes, edges)


def graph_node_names(roots: Iterable[Tensor]) -> set[str]:
    """The class names of the backward nodes that ``roots`` depend on (``MulBackward0``,
    ``ReluBackward0``, ``AccumulateGrad``...)."""
    return walk_backward_graph(roots).names()


def graph_leaves(roots: Iterable[Tensor]) -> list[Tensor]:
    """The leaves requiring grad that ``roots`` depend on (the ``AccumulateGrad`` nodes'
    tensors), in breadth-first discovery order, each once."""
    return walk_backward_graph(roots).leaves()


def autograd_graph(tensor: Tensor, parameters: Mapping[str, Tensor] | None = None
                   ) -> AutogradGraph:
    """The backward graph of ``tensor``: its ``grad_fn`` and every node reachable from it (each
    once), numbered in breadth-first discovery order from the root (node 0).

    ``parameters`` (name -> tensor, e.g. ``dict(model.named_parameters())``) name the leaves
    that are among them. Nodes created while a backward ran (the graph of a gradient) are
    marked ``double_backward`` where ``tensor`` was computed under
    ``torch.autograd.set_detect_anomaly(True)``, which records that; otherwise none is."""
    if tensor.grad_fn is None:
        raise ValueError(
            "the tensor has no grad_fn: it is a leaf or was computed without grad, so it has no "
            "backward graph. Pass a tensor computed from inputs that require grad."
        )
    walked = walk_backward_graph([tensor])
    names = {id(value): name for name, value in (parameters or {}).items()}
    nodes = []
    for index, fn in enumerate(walked.nodes):
        variable = getattr(fn, "variable", None)
        nodes.append(GraphNode(
            index=index,
            name=type(fn).__name__,
            is_leaf=variable is not None,
            leaf_shape=None if variable is None else tuple(variable.shape),
            label=None if variable is None else names.get(id(variable)),
            double_backward=variable is None and created_by_a_backward(fn),
        ))
    return AutogradGraph(nodes, walked.edges)


@dataclass(frozen=True)
class CollapsedGraph:
    """A backward graph with each module call drawn as one box: ``members[b]`` are the nodes of
    the :class:`AutogradGraph` in box ``b`` (its first member names it), ``labels[b]`` the box's
    text, ``kinds[b]`` one of ``module`` (a module call), ``forward``, ``double_backward``,
    ``parameter`` and ``leaf``; ``edges`` between boxes, each once (a box's own edges and the
    edges into the parameters it holds are gone)."""

    members: list[tuple[int, ...]]
    labels: list[str]
    kinds: list[str]
    edges: list[GraphEdge]


def _module_of(label: str | None) -> str:
    """``critic.fc1.weight`` -> ``critic.fc1``; a parameter of no submodule -> ``""``."""
    return label.rsplit(".", 1)[0] if label and "." in label else ""


def collapse_module_calls(graph: AutogradGraph, module_kinds: Mapping[str, str] | None = None
                          ) -> CollapsedGraph:
    """``graph`` with the nodes of each module call merged into one box, e.g. a ``Linear`` call's
    ``AddmmBackward0``, the ``TBackward0`` of its weight and the ``AccumulateGrad`` of its weight
    and bias into ``fc1 (Linear)``.

    Read off the graph alone: a *parameter view* is a forward node (not double backward) whose
    one successor is a parameter leaf of a module ``M`` (``TBackward0`` of ``M.weight``); a
    *call* of ``M`` is a forward node whose parameter leaves, directly or through views, are all
    of ``M``'s parameters in the graph (``Addmm`` reaches bias and weight, a weight decay's
    ``Pow`` of the weight alone does not), and that has an input besides them or reaches two
    parameters or more (a ``Conv2d`` of an input without grad: weight and bias; not the ``Pow``
    of a bias-free layer's weight, nor the ``T`` of a weight). A call's box holds the call and
    its views (a view two calls share goes to the first, a view outside every call, e.g. of a
    call whose output the loss does not use but whose gradient it does, is a box of its own); a
    parameter leaf goes into the boxes of its module's calls when all its predecessors are in
    them, and stays a box of its own otherwise (read by a weight decay's ``Pow``, by such a
    view, or by a double backward that reads the weight directly). Labels: the module's name
    without the first part that every module of the graph shares (``backbone.``, ``critic.``)
    and its class from ``module_kinds`` (name -> class name); other nodes keep their names,
    leaves their parameter's name or their shape."""
    module_kinds = module_kinds or {}
    successors: dict[int, list[int]] = {node.index: [] for node in graph.nodes}
    predecessors: dict[int, list[int]] = {node.index: [] for node in graph.nodes}
    for edge in graph.edges:
        successors[edge.source].append(edge.target)
        predecessors[edge.target].append(edge.source)
    module = {node.index: _module_of(node.label) for node in graph.nodes
              if node.is_leaf and _module_of(node.label)}
    parameters: dict[str, set[int]] = {}
    for leaf, name in module.items():
        parameters.setdefault(name, set()).add(leaf)

    def forward_op(index: int) -> bool:
        node = graph.nodes[index]
        return not node.is_leaf and not node.double_backward

    views = {}  # view -> its module
    for node in graph.nodes:
        if forward_op(node.index) and len(successors[node.index]) == 1 and (
                successors[node.index][0] in module):
            views[node.index] = module[successors[node.index][0]]
    box_of: dict[int, int] = {}
    members: list[list[int]] = []
    calls: dict[int, str] = {}  # box -> module
    for node in graph.nodes:
        if node.index in box_of or not forward_op(node.index):
            continue
        parts = [t for t in successors[node.index] if t in module or t in views]
        reached = {leaf for t in parts for leaf in ([t] if t in module else successors[t])}
        names = {module[leaf] for leaf in reached}
        if len(names) != 1 or reached != parameters[next(iter(names))] or (
                len(parts) == len(successors[node.index]) and len(reached) < 2):
            continue
        box_of[node.index] = len(members)
        calls[len(members)] = names.pop()
        members.append([node.index])
        for view in parts:
            if view in views and view not in box_of:
                box_of[view] = box_of[node.index]
                members[-1].append(view)
    absorbed = {leaf for leaf, name in module.items() if predecessors[leaf] and all(
        calls.get(box_of.get(p, -1)) == name for p in predecessors[leaf])}
    for node in graph.nodes:
        if node.index not in box_of and node.index not in absorbed:
            box_of[node.index] = len(members)
            members.append([node.index])
    for leaf in absorbed:  # shown in the label of its module's calls
        for box in {box_of[p] for p in predecessors[leaf]}:
            members[box].append(leaf)
    order = sorted(range(len(members)), key=lambda box: members[box][0])
    renumber = {box: k for k, box in enumerate(order)}
    firsts = {name.split(".", 1)[0] for name in module.values()}
    common = f"{firsts.pop()}." if len(firsts) == 1 and all(
        "." in name for name in module.values()) else ""
    labels, kinds = [], []
    for box in order:
        first = graph.nodes[members[box][0]]
        if box in calls:
            name = calls[box].removeprefix(common)
            kind = module_kinds.get(calls[box])
            labels.append(f"{name} ({kind})" if kind else name)
            kinds.append("module")
        elif first.is_leaf:
            labels.append(first.label.removeprefix(common) if first.label
                          else f"leaf {list(first.leaf_shape or ())}")
            kinds.append("parameter" if first.label else "leaf")
        else:
            labels.append(first.name)
            kinds.append("double_backward" if first.double_backward else "forward")
    edges: dict[tuple[int, int], GraphEdge] = {}
    for edge in graph.edges:
        if edge.target in absorbed:
            continue
        source, target = renumber[box_of[edge.source]], renumber[box_of[edge.target]]
        if source != target and (source, target) not in edges:
            edges[source, target] = GraphEdge(source, target, edge.input_nr, len(edges))
    return CollapsedGraph([tuple(sorted(members[box])) for box in order], labels, kinds,
                          list(edges.values()))
