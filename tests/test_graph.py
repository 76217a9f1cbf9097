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


# --- module calls collapsed into boxes (the picture's graph) -------------------------------------


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def kinds_of(module: nn.Module) -> dict[str, str]:
    return {name: type(sub).__name__ for name, sub in module.named_modules()}


def boxes_and_edges(collapsed: gradreg.graph.CollapsedGraph) -> tuple[list[str], set]:
    labels = collapsed.labels
    return labels, {(labels[e.source], labels[e.target]) for e in collapsed.edges}


def test_each_linear_call_is_one_box_with_its_parameters_and_the_gradients_graph_stays() -> None:
    """y = sum fc2(relu(fc1(x))) + ||dy/dx||^2: the 19 nodes (printed by ``to_text``) become 13
    boxes. fc2's box holds Addmm [3], the T [7] of its weight and the leaves bias [5] and weight
    [10]; fc1's Addmm [9], T [15], bias [13] and weight [17]. The gradient's double-backward
    T nodes [12] and [18] read the forward T of the other layer's weight, so they point to that
    layer's box; the input x stays a leaf."""
    net = TwoLayers()
    x = torch.randn(5, 3, requires_grad=True)
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        out = net(x).sum()
        loss = out + gradreg.gradient(out, x).square().sum()
    graph = gradreg.autograd_graph(loss, dict(net.named_parameters()))
    collapsed = gradreg.graph.collapse_module_calls(graph, kinds_of(net))
    labels, edges = boxes_and_edges(collapsed)
    assert len(graph.nodes) == 19
    assert labels == ["AddBackward0", "SumBackward0", "SumBackward0", "fc2 (Linear)",
                      "PowBackward0", "ReluBackward0", "MmBackward0", "fc1 (Linear)",
                      "ThresholdBackwardBackward0", "TBackward0", "leaf [5, 3]", "MmBackward0",
                      "TBackward0"]
    assert collapsed.kinds == ["forward"] * 3 + ["module", "forward", "forward",
                                                 "double_backward", "module", "double_backward",
                                                 "double_backward", "leaf", "double_backward",
                                                 "double_backward"]
    assert collapsed.members[3] == (3, 5, 7, 10) and collapsed.members[7] == (9, 13, 15, 17)
    assert [(e.source, e.target) for e in collapsed.edges] == [
        (0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6), (5, 7), (6, 8), (6, 9), (7, 10),
        (8, 11), (8, 5), (9, 7), (11, 12), (12, 3)]
    assert ("fc1 (Linear)", "leaf [5, 3]") in edges and ("TBackward0", "fc2 (Linear)") in edges
    # every node is in a box, each once (no parameter is shared by two calls here)
    assert sorted(n for box in collapsed.members for n in box) == list(range(19))
    # the text and DOT forms stay the full graph
    assert graph.to_text().count("\n") == 18 and graph.to_dot().count("->") == len(graph.edges)


def test_a_weight_decay_term_is_not_a_module_call_and_keeps_the_weight_a_leaf() -> None:
    """sum fc1(x) + sum(fc1.weight^2): Pow reaches the weight alone, not fc1's bias, so it is no
    call; the weight, read by the call's T and by Pow, stays a box of its own (green leaf)
    that both point to; the bias, read by the call alone, goes into the call's box."""
    fc1 = nn.Linear(3, 2)
    net = nn.Module()
    net.fc1 = fc1
    loss = fc1(torch.randn(4, 3)).sum() + fc1.weight.pow(2).sum()
    collapsed = gradreg.graph.collapse_module_calls(
        gradreg.autograd_graph(loss, dict(net.named_parameters())), kinds_of(net))
    labels, edges = boxes_and_edges(collapsed)
    assert labels == ["AddBackward0", "SumBackward0", "SumBackward0", "fc1 (Linear)",
                      "PowBackward0", "fc1.weight"]
    assert {("fc1 (Linear)", "fc1.weight"), ("PowBackward0", "fc1.weight")} <= edges
    assert collapsed.kinds[labels.index("fc1.weight")] == "parameter"


def test_a_critic_called_three_times_has_three_boxes_per_layer_named_without_its_prefix() -> None:
    """WGAN-GP's critic loss: D(fake) - D(real) + (||dD(x)/dx|| - 1)^2, D = critic.fc (one
    Linear). The penalty's call of fc is not in the graph (only its gradient is), so the T of
    its weight, read by the gradient's graph, is a box ``TBackward0`` of its own over the
    weight ``fc.weight``, which stays a leaf; the calls on fake and real are ``fc (Linear)``
    each (the shared ``critic.`` dropped from the names)."""
    net = nn.Module()
    net.critic = nn.Module()
    net.critic.fc = nn.Linear(2, 1)
    real, fake = torch.randn(4, 2), torch.randn(4, 2)
    x = (0.5 * real + 0.5 * fake).requires_grad_()
    grad = gradreg.gradient(net.critic.fc(x).sum(), x)
    loss = (net.critic.fc(fake).mean() - net.critic.fc(real).mean()
            + (grad.norm(dim=1) - 1).pow(2).mean())
    collapsed = gradreg.graph.collapse_module_calls(
        gradreg.autograd_graph(loss, dict(net.named_parameters())), kinds_of(net))
    labels, edges = boxes_and_edges(collapsed)
    assert labels.count("fc (Linear)") == 2 and "fc.weight" in labels
    assert collapsed.kinds[labels.index("fc.weight")] == "parameter"
    assert ("TBackward0", "fc.weight") in edges and ("fc (Linear)", "fc.weight") in edges
    assert not [label for label in labels if "critic" in label or "AccumulateGrad" in label]


def test_a_weight_the_gradients_graph_reads_directly_stays_a_leaf() -> None:
    """sum conv(x) + ||d/dx||^2 through tanh: ConvolutionBackwardBackward0 (double backward)
    reads conv.weight's AccumulateGrad itself, so the weight is a box of its own; the bias, read
    by the call alone, is in ``conv (Conv2d)``. Without parameter names nothing collapses."""
    net = nn.Module()
    net.conv = nn.Conv2d(1, 2, 3)
    x = torch.randn(3, 1, 4, 4, requires_grad=True)
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        out = torch.tanh(net.conv(x)).sum()
        loss = out + gradreg.gradient(out, x).square().sum()
    graph = gradreg.autograd_graph(loss, dict(net.named_parameters()))
    collapsed = gradreg.graph.collapse_module_calls(graph, kinds_of(net))
    labels, edges = boxes_and_edges(collapsed)
    call = labels.index("conv (Conv2d)")
    assert [graph.nodes[n].name for n in collapsed.members[call]] == [
        "ConvolutionBackward0", "AccumulateGrad"]
    assert graph.nodes[collapsed.members[call][1]].label == "conv.bias"
    assert {("conv (Conv2d)", "conv.weight"), ("conv (Conv2d)", "leaf [3, 1, 4, 4]"),
            ("ConvolutionBackwardBackward0", "conv.weight")} <= edges
    plain = gradreg.graph.collapse_module_calls(gradreg.autograd_graph(loss))
    assert len(plain.labels) == len(graph.nodes) and "module" not in plain.kinds


def test_a_call_without_an_input_needs_two_parameters() -> None:
    """A Conv2d of an input without grad: ConvolutionBackward0's successors are weight and bias
    alone, and it is the call ``conv (Conv2d)`` (3 nodes, 2 boxes: Sum and the call). A bias-free
    Linear's weight decay sum(w^2): Pow reaches the one weight and has no input, so it is no
    call: Sum, Pow and the leaf ``fc.weight`` stay three boxes."""
    net = nn.Module()
    net.conv = nn.Conv2d(1, 2, 3)
    net.fc = nn.Linear(2, 2, bias=False)
    names = dict(net.named_parameters())
    conv = gradreg.graph.collapse_module_calls(
        gradreg.autograd_graph(net.conv(torch.randn(1, 1, 4, 4)).sum(), names), kinds_of(net))
    assert (conv.labels, conv.kinds) == (["SumBackward0", "conv (Conv2d)"], ["forward", "module"])
    decay = gradreg.graph.collapse_module_calls(
        gradreg.autograd_graph(net.fc.weight.pow(2).sum(), names), kinds_of(net))
    assert decay.labels == ["SumBackward0", "PowBackward0", "fc.weight"]
    assert decay.kinds == ["forward", "forward", "parameter"]
