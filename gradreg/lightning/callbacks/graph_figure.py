r"""A picture of a backward graph: nodes in layers from the loss down to the leaves.

The layout is the layered (Sugiyama-style) drawing of a directed acyclic graph, in plain Python
and matplotlib: each node's layer is its longest distance from the root (so every edge points
down), the nodes of a layer are ordered by the mean position of their parents (a few sweeps of
the barycentre heuristic, which reduces edge crossings), and edges are straight lines.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from gradreg.graph import GraphEdge

# node kind -> (fill colour, legend)
KINDS = {
    "forward": ("#cfe2f3", "backward of a forward op"),
    "double_backward": ("#f9b872", "double backward: the graph of the gradient"),
    "parameter": ("#b6d7a8", "leaf: parameter"),
    "leaf": ("#d9d9d9", "leaf: other tensor (inputs)"),
}


def short_name(name: str) -> str:
    """``AddmmBackward0`` -> ``Addmm``; ``ThresholdBackwardBackward0`` -> ``ThresholdBackward``."""
    return re.sub(r"Backward\d*$", "", name) or name


def layers(count: int, edges: Sequence[GraphEdge]) -> list[list[int]]:
    """Nodes ``0..count-1`` by layer: a node's layer is its longest distance from node 0 along
    the edges (source above target); within a layer, ordered by the barycentre heuristic."""
    children, parents = defaultdict(list), defaultdict(list)
    for edge in edges:
        children[edge.source].append(edge.target)
        parents[edge.target].append(edge.source)
    depth = dict.fromkeys(range(count), 0)
    waiting = {node: len(set(parents[node])) for node in range(count)}
    ready = [node for node in range(count) if waiting[node] == 0]
    while ready:  # Kahn's topological order; depth = longest path
        node = ready.pop()
        for child in set(children[node]):
            depth[child] = max(depth[child], depth[node] + 1)
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    rows: list[list[int]] = [[] for _ in range(max(depth.values(), default=0) + 1)]
    for node in range(count):
        rows[depth[node]].append(node)
    for _ in range(3):
        position = {node: k / max(len(row), 1) for row in rows for k, node in enumerate(row)}
        for row in rows[1:]:
            row.sort(key=lambda node: sum(position[p] for p in parents[node])
                     / max(len(parents[node]), 1))
            position.update({node: k / max(len(row), 1) for k, node in enumerate(row)})
    return rows


def graph_figure(
    names: Sequence[str], kinds: Sequence[str], edges: Sequence[GraphEdge],
    labels: Mapping[int, str] | None = None, title: str = "",
) -> Figure:
    """The graph as a layered picture: the root (the loss) at the top, the leaves at the bottom,
    each node a box coloured by ``kinds[i]`` (a key of :data:`KINDS`) that reads
    :func:`short_name` of ``names[i]`` or ``labels[i]`` (a parameter's name)."""
    labels = labels or {}
    rows = layers(len(names), edges)
    width = max(len(row) for row in rows)
    present = [kind for kind in KINDS if kind in set(kinds)]
    top = 0.5 + 0.3 * len(present)  # inches above the drawing: title and legend
    fig = Figure(figsize=(max(1.75 * width, 5.0), 0.62 * len(rows) + top + 0.2), dpi=80)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0 - top / fig.get_figheight()))
    xy = {node: ((k + 0.5) / len(row) * width, -depth)
          for depth, row in enumerate(rows) for k, node in enumerate(row)}
    ax.add_collection(LineCollection([(xy[e.source], xy[e.target]) for e in edges],
                                     colors="#888888", linewidths=0.8, zorder=1))
    for node, (x, y) in xy.items():
        ax.text(x, y, labels.get(node, short_name(names[node])), ha="center", va="center",
                fontsize=12, zorder=2,
                bbox={"boxstyle": "round,pad=0.25", "facecolor": KINDS[kinds[node]][0],
                      "edgecolor": "#555555"})
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(-len(rows) + 0.5, 0.5)
    ax.axis("off")
    fig.legend(handles=[Patch(facecolor=KINDS[k][0], edgecolor="#555555", label=KINDS[k][1])
                        for k in present],
               loc="upper left", fontsize=12, frameon=False,
               bbox_to_anchor=(0.0, 1.0 - 0.4 / fig.get_figheight()))
    fig.suptitle(title, fontsize=13, x=0.02, y=1.0 - 0.05 / fig.get_figheight(), ha="left",
                 va="top")
    return fig
