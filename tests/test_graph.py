"""autograd_graph on seed 003's A, B, E example and on the graph of a gradient."""

import pytest
import torch
from torch import nn

import gradreg
from tests.residual_net import ResidualNet


def seed_003_F() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(0.5, requires_grad=True)
    e = torch.tensor(1.0, requires_grad=True)
    return (a * b).exp() + e, (a, b, e)


def test_seed_003_nodes_and_edges() -> None:
    f, _ = seed_003_F()
    graph = gradreg.autograd_graph(f)
    assert graph.names() == [
        "AddBackward0", "ExpBackward0", "AccumulateGrad", "MulBackward0", "AccumulateGrad",
        "AccumulateGrad",
    ]
    edges = {(graph.nodes[e.source].name, e.slot, graph.nodes[e.target].name, e.input_nr)
             for e in graph.edges}
    assert edges == {
        ("AddBackward0", 0, "ExpBackward0", 0),  # F = D + E: D's node first
        ("AddBackward0", 1, "AccumulateGrad", 0),  # then leaf E
        ("ExpBackward0", 0, "MulBackward0", 0),
        ("MulBackward0", 0, "AccumulateGrad", 0),  # A
        ("MulBackward0", 1, "AccumulateGrad", 0),  # B
    }
    assert [n.is_leaf for n in graph.nodes] == [False, False, True, False, True, True]
    assert [n.name for n in graph.successors(3)] == ["AccumulateGrad", "AccumulateGrad"]


def test_text_and_dot_renderings() -> None:
    f, _ = seed_003_F()
    graph = gradreg.autograd_graph(f)
    text = graph.to_text()
    assert text.splitlines()[0] == (
        "[0] AddBackward0 -> [1] ExpBackward0 (input 0), [2] AccumulateGrad (input 0)"
    )
    assert "[2] AccumulateGrad (leaf [])" in text
    dot = graph.to_dot()
    assert dot.startswith("digraph autograd {") and dot.endswith("}")
    assert 'n0 [label="AddBackward0", shape=ellipse];' in dot
    assert "n0 -> n1" in dot and dot.count("->") == 5


def test_graph_of_a_create_graph_gradient_links_back_to_forward_graph() -> None:
    f, (a, _, _) = seed_003_F()
    ga = gradreg.gradient(f, a)  # d/dA exp(A B) = B exp(A B)
    assert ga.item() == pytest.approx(0.5 * torch.e)
    graph = gradreg.autograd_graph(ga)
    names = set(graph.names())
    assert {"MulBackward0", "ExpBackward0", "AccumulateGrad"} <= names
    leaf_shapes = [n.leaf_shape for n in graph.nodes if n.is_leaf]
    assert leaf_shapes and all(s == () for s in leaf_shapes)
    assert len(graph.nodes) == len({n.index for n in graph.nodes})


def test_leaf_tensor_has_no_graph() -> None:
    with pytest.raises(ValueError, match="no grad_fn"):
        gradreg.autograd_graph(torch.ones(1, requires_grad=True))


# The walks below failed on torch 2.11 when nodes were told apart by the id() of wrappers the walk
# had dropped: 2.11 frees a node's Python wrapper with its last reference, the next wrapper reuses
# the address, and unvisited nodes looked seen, so the walk stopped after two or three nodes.


def test_walk_of_a_deep_graph_finds_every_node() -> None:
    x = torch.ones(2, requires_grad=True)
    y = x
    for _ in range(3000):  # deeper than Python's recursion limit
        y = y.sin()
    graph = gradreg.graph.walk_backward_graph([y.sum()])
    names = [type(node).__name__ for node in graph.nodes]
    assert names.count("SinBackward0") == 3000
    assert names[0] == "SumBackward0" and names[-1] == "AccumulateGrad" and len(names) == 3002
    assert len(graph.edges) == 3001
    assert len(gradreg.autograd_graph(y.sum()).nodes) == 3002
    assert gradreg.graph.graph_leaves([y]) == [x]


def test_walk_finds_every_parameter_of_a_resnet_like_model_and_of_its_penalty() -> None:
    torch.manual_seed(0)
    model = ResidualNet(nn.Tanh)
    x = torch.randn(2, 1, 6, 6, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 2]))
    params = {id(p) for p in model.parameters()}
    assert len(params) == 2 + 3 * 6 + 2  # stem w, b; per block 2 convs, 2 BNs (w, b); head w, b
    found = gradreg.graph.graph_leaves([loss])
    assert {id(t) for t in found} == params | {id(x)} and len(found) == len(params) + 1
    (g,) = torch.autograd.grad(loss, x, create_graph=True)  # the double-backprop graph
    assert {id(t) for t in gradreg.graph.graph_leaves([g.square().sum()])} == params | {id(x)}
    names = gradreg.graph.graph_node_names([g])
    assert {"ConvolutionBackwardBackward0", "NativeBatchNormBackwardBackward0",
            "TanhBackwardBackward0"} <= names


def test_the_graph_names_parameters_and_marks_the_gradients_nodes() -> None:
    """``w * x`` and its gradient ``d(wx)/dx = w`` squared: built under anomaly mode, the nodes of
    the gradient's graph are marked (text: ``[double backward]``, DOT: filled orange); the
    parameter leaf is named (text and DOT: ``w [2]``, DOT: filled green)."""
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    x = torch.tensor([3.0, 4.0], requires_grad=True)
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        (grad,) = torch.autograd.grad((w * x).sum(), x, create_graph=True)
        loss = grad.square().sum()
    graph = gradreg.autograd_graph(loss, {"w": w})
    marked = [node.name for node in graph.nodes if node.double_backward]
    assert marked and all(not node.is_leaf for node in graph.nodes if node.double_backward)
    text = graph.to_text()
    assert "AccumulateGrad (w [2])" in text and "[double backward]" in text
    dot = graph.to_dot()
    assert 'label="AccumulateGrad (w [2])", shape=box, style=filled, fillcolor="#b6d7a8"' in dot
    assert 'fillcolor="#f9b872"' in dot
    # without anomaly mode nothing is marked; without names the leaves read "leaf"
    plain = gradreg.autograd_graph((w * x).sum())
    assert not any(node.double_backward for node in plain.nodes)
    assert "AccumulateGrad (leaf [2])" in plain.to_text()
