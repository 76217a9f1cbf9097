r"""A picture of a backward graph: nodes in layers from the loss down to the leaves, drawn to be
read where TensorBoard shows it.

The layout is the layered (Sugiyama-style) drawing of a directed acyclic graph, in plain Python
and matplotlib: each node's layer is its longest distance from the root (so every edge points
down), the nodes of a layer are ordered by the mean position of their parents (a few sweeps of
the barycentre heuristic, which reduces edge crossings), and edges are straight lines. A layer
wider than the picture wraps onto the next rows.

Size: TensorBoard's Images tab draws an image :data:`CARD_WIDTH` (350) px wide whatever its own
width, scaled with nearest-neighbour sampling (``image-rendering: pixelated``), which drops
rows and columns of pixels and breaks letters unless the ratio is whole. So the picture is
:data:`WIDTH` inches at :data:`DPI`, 700 px, twice the card, and an even number of pixels
high: the card keeps every other row and column. Its text is :data:`FONT_SIZE` points:
``FONT_SIZE * DPI / 72 * CARD_WIDTH / (WIDTH * DPI)`` = 10.7 px on the card; lines are 1 pt.
Its height grows with the number of rows; the card scrolls past 1024 px.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from gradreg.graph import GraphEdge

CARD_WIDTH = 350  # px: the width of an image in TensorBoard's Images tab
WIDTH = 5.0  # inches
DPI = 140
FONT_SIZE = 11  # points
ROW = 0.42  # inches from one row of boxes to the next
LINE = 0.22  # inches: a line of the title or legend

# node kind -> (fill colour, legend)
KINDS = {
    "module": ("#b6d7a8", "module call: its op and parameters"),
    "forward": ("#cfe2f3", "backward of a forward op"),
    "double_backward": ("#f9b872", "double backward: the graph of the gradient"),
    "parameter": ("#d9ead3", "leaf: parameter"),
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


def text_width(label: str) -> float:
    """An upper bound of the width in inches of ``label`` in a box at :data:`FONT_SIZE`: 0.62 em
    per character (DejaVu Sans' widest letters are 0.7 em, its lower case 0.5-0.6) and the
    box's padding."""
    return (0.62 * len(label) + 0.8) * FONT_SIZE / 72


def fit(label: str) -> str:
    """``label``, or where it is wider than the picture, its start and end around an ellipsis
    (the text and DOT forms have the whole name)."""
    most = int((WIDTH * 72 / FONT_SIZE - 0.8) / 0.62)  # characters of text_width <= WIDTH
    if len(label) <= most:
        return label
    head = (most - 1) // 2
    return f"{label[:head]}…{label[len(label) - (most - 1 - head):]}"


def wrap(row: Sequence[int], widths: Mapping[int, float], width: float) -> list[list[int]]:
    """The nodes of one layer, in order, cut into rows whose boxes fit side by side in
    ``width`` inches (a box wider than that alone on its row)."""
    rows: list[list[int]] = [[]]
    for node in row:
        if rows[-1] and sum(widths[n] for n in rows[-1]) + widths[node] > width:
            rows.append([])
        rows[-1].append(node)
    return rows


def graph_figure(
    names: Sequence[str], kinds: Sequence[str], edges: Sequence[GraphEdge],
    labels: Mapping[int, str] | None = None, title: str = "",
) -> Figure:
    """The graph as a layered picture: the root (the loss) at the top, the leaves at the bottom,
    each node a box coloured by ``kinds[i]`` (a key of :data:`KINDS`) that reads
    :func:`short_name` of ``names[i]`` or ``labels[i]`` (a parameter's or module's name).

    :data:`WIDTH` inches wide, text at :data:`FONT_SIZE`: legible at TensorBoard's card size;
    the rows of a layer are spread evenly over the width, boxes in the order of the layout."""
    labels = labels or {}
    text = {node: fit(labels.get(node, short_name(names[node]))) for node in range(len(names))}
    widths = {node: text_width(label) for node, label in text.items()}
    rows = [line for row in layers(len(names), edges) for line in wrap(row, widths, WIDTH)]
    present = [kind for kind in KINDS if kind in set(kinds)]
    top = LINE * (title.count("\n") + 1 + len(present)) + 0.25  # title and legend
    height = 2 * math.ceil((ROW * len(rows) + top) * DPI / 2) / DPI  # even in pixels
    fig = Figure(figsize=(WIDTH, height), dpi=DPI)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0 - top / fig.get_figheight()))
    xy = {}
    for depth, row in enumerate(rows):
        gap = (WIDTH - sum(widths[node] for node in row)) / len(row)
        left = gap / 2
        for node in row:
            xy[node] = (left + widths[node] / 2, -depth)
            left += widths[node] + gap
    ax.add_collection(LineCollection([(xy[e.source], xy[e.target]) for e in edges],
                                     colors="#888888", linewidths=1.0, zorder=1))
    for node, (x, y) in xy.items():
        ax.text(x, y, text[node], ha="center", va="center", fontsize=FONT_SIZE, zorder=2,
                bbox={"boxstyle": "round,pad=0.25", "facecolor": KINDS[kinds[node]][0],
                      "edgecolor": "#555555"})
    ax.set_xlim(0.0, WIDTH)
    ax.set_ylim(-len(rows) + 0.5, 0.5)
    ax.axis("off")
    fig.suptitle(title, fontsize=FONT_SIZE, x=0.02, y=1.0 - 0.05 / fig.get_figheight(),
                 ha="left", va="top")
    fig.legend(handles=[Patch(facecolor=KINDS[k][0], edgecolor="#555555", label=KINDS[k][1])
                        for k in present],
               loc="upper left", fontsize=FONT_SIZE, frameon=False, borderpad=0.0,
               labelspacing=0.3, handlelength=1.5,
               bbox_to_anchor=(0.02, 1.0 - (LINE * (title.count("\n") + 1) + 0.1)
                               / fig.get_figheight()))
    return fig
