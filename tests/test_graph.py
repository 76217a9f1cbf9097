"""autograd_graph on seed 003's A, B, E example and on the graph of a gradient."""

import pytest
import torch

import gradreg


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
