"""torch's private names that gradreg uses, pinned: a torch release that moves one fails here,
naming it, the torch version and gradreg/torch_compat.py, the one module to change."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import gradreg
from gradreg.batchnorm import BatchNorm1d
from gradreg.graph import walk_backward_graph
from gradreg.sharding import supports_exact_step
from gradreg.torch_compat import (
    ANOMALY_PARENT_KEY,
    COMPILED_NODE,
    FSDP_POST_BACKWARD_NODE,
    SAVED_TRAINING,
    BatchNormBase,
    NormBase,
    TorchDispatchMode,
    attention_in_functional,
    batchnorm_node_in_training,
    created_by_a_backward,
    dtensor_type,
    dynamo_supported,
    fsdp_group_mesh_ndim,
    fsdp_group_name,
    fsdp_group_of_node,
    fsdp_group_offloads_to_cpu,
    fsdp_group_params,
    fsdp_group_reduces_gradients,
    fsdp_module_type,
    fsdp_param_groups,
    fsdp_param_name,
    fsdp_param_received_gradient,
    fsdp_sharded_param,
    fsdp_step_settings,
    fsdp_unsharded_param,
    once_differentiable_function,
    run_fsdp_post_backward,
)
from tests.one_rank_fsdp import one_rank, shard

PRIVATE_NAMES = [("torch.nn.modules.batchnorm", "_BatchNorm"),
                 ("torch.nn.modules.batchnorm", "_NormBase"),
                 ("torch.utils._python_dispatch", "TorchDispatchMode"),
                 ("torch._dynamo", "is_dynamo_supported")]


def moved(name: str) -> str:
    return f"torch {torch.__version__} has no {name}: update gradreg/torch_compat.py"


@pytest.mark.parametrize(("module", "name"), PRIVATE_NAMES)
def test_the_private_names_still_exist(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), moved(f"{module}.{name}")


def test_the_batchnorm_base_is_that_of_torchs_batchnorms() -> None:
    assert all(issubclass(cls, BatchNormBase)
               for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, BatchNorm1d)), moved(
        "torch.nn.modules.batchnorm._BatchNorm as the base of nn.BatchNorm1d/2d/3d")


def test_the_norm_base_is_that_of_the_normalization_layers_with_running_statistics() -> None:
    assert all(issubclass(cls, NormBase)
               for cls in (nn.BatchNorm2d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
                           BatchNorm1d)), moved(
        "torch.nn.modules.batchnorm._NormBase as the base of BatchNorm, SyncBatchNorm and "
        "InstanceNorm")


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_nodes_say_their_mode(training: bool) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    node = nn.BatchNorm1d(3).train(training)(x).grad_fn
    assert hasattr(node, SAVED_TRAINING), moved(f"{type(node).__name__}.{SAVED_TRAINING}")
    assert batchnorm_node_in_training(node) is training


def test_a_dispatch_mode_sees_the_aten_ops_of_a_backward() -> None:
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
            seen.append(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(3, 4)
    with Record():
        (x @ w).sum().backward()
    assert torch.ops.aten.mm in seen, moved("a TorchDispatchMode that sees aten.mm")


def test_modules_still_load_their_state_through_load_from_state_dict() -> None:
    """GradientPenalty overrides it (to widen its running mean before a float64 one loads)."""
    names = list(inspect.signature(nn.Module._load_from_state_dict).parameters)
    assert names[:3] == ["self", "state_dict", "prefix"], moved(
        f"nn.Module._load_from_state_dict(self, state_dict, prefix, ...) (it takes {names})")


def test_dynamo_support_is_a_bool() -> None:
    assert dynamo_supported() in (True, False)


# FSDP2: a module sharded over one rank in this process (gloo), its private names pinned.

FSDP2_PUBLIC = supports_exact_step()
needs_fsdp2 = pytest.mark.skipif(not FSDP2_PUBLIC, reason="FSDP2 (fully_shard) is public from "
                                 "torch 2.6; gradreg.sharding refuses older torch")


@pytest.fixture(scope="module")
def sharded() -> Iterator[dict[str, object]]:
    """A 2-layer critic sharded by ``fully_shard`` per layer and at the root on a 1-rank mesh,
    after one forward and backward of points that require grad: its FSDP2 objects by role."""
    with one_rank() as mesh:
        torch.manual_seed(0)
        model = shard(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), mesh)
        outputs = model(torch.randn(5, 3, requires_grad=True))
        nodes = walk_backward_graph([outputs]).nodes
        outputs.sum().backward()
        state = model[0]._get_fsdp_state()
        group = fsdp_param_groups(model[0])[0]
        yield {"model": model, "module": model[0], "state": state, "group": group,
               "mesh_info": group.mesh_info, "state_ctx": state._state_ctx, "nodes": nodes,
               "param": fsdp_group_params(group)[0]}


FSDP_PRIVATE_NAMES = [
    ("module", "_get_fsdp_state"), ("state", "_auto_reshard_after_forward"),
    ("state", "_state_ctx"), ("state_ctx", "is_last_backward"),
    *(("group", name) for name in ("post_forward_mesh_info", "reshard_after_backward",
                                   "reduce_grads", "all_reduce_grads", "post_backward",
                                   "finalize_backward", "_training_state", "_module_fqn",
                                   "fsdp_params", "mesh_info")),
    ("mesh_info", "mesh"),
    *(("param", name) for name in ("sharded_param", "_unsharded_param",
                                   "unsharded_accumulated_grad", "_param_fqn", "offload_to_cpu")),
]


@needs_fsdp2
@pytest.mark.parametrize(("role", "name"), FSDP_PRIVATE_NAMES)
def test_fsdp2s_private_names_still_exist(sharded: dict, role: str, name: str) -> None:
    owner = sharded[role]
    assert hasattr(owner, name), moved(f"{type(owner).__name__}.{name} (FSDP2)")


def test_fsdp2s_module_class_is_found() -> None:
    """Public from torch 2.6; in 2.4 and 2.5 only under a private path."""
    module = "torch.distributed.fsdp" if FSDP2_PUBLIC else "torch.distributed._composable.fsdp"
    expected = getattr(importlib.import_module(module), "FSDPModule", None)
    assert expected is not None and fsdp_module_type() is expected, moved(f"{module}.FSDPModule")


@needs_fsdp2
def test_fsdp2s_parameter_groups(sharded: dict) -> None:
    state = sharded["state"]
    assert fsdp_param_groups(sharded["module"]) == [sharded["group"]], moved(
        f"{type(state).__name__}._fsdp_param_groups or ._fsdp_param_group (FSDP2)")
    assert fsdp_param_groups(sharded["model"]) != [sharded["group"]]  # each module its own


@needs_fsdp2
def test_fsdp2s_settings_are_held_and_restored(sharded: dict) -> None:
    settings = fsdp_step_settings(sharded["module"])
    for each in settings:
        assert each.own.keys() == each.held.keys(), moved(
            f"{sorted(each.held.keys() - each.own.keys())} on {type(each.target).__name__}")
    own = [each.current() for each in settings]
    for each in settings:
        each.hold()
    assert [each.current() for each in settings] == [each.held for each in settings]
    for each in settings:
        each.restore()
    assert [each.current() for each in settings] == own


@needs_fsdp2
def test_fsdp2s_parameters_say_their_gradient_and_name(sharded: dict) -> None:
    param = sharded["param"]
    assert fsdp_param_name(param) == "0.weight"
    assert fsdp_sharded_param(param) is sharded["module"].weight
    assert fsdp_sharded_param(param).grad is not None  # reduced by the backward
    assert not fsdp_param_received_gradient(param)  # and the unsharded gradient is gone
    group = sharded["group"]
    assert fsdp_group_name(group) == "0" and fsdp_group_mesh_ndim(group) == 1
    assert not fsdp_group_offloads_to_cpu(group) and fsdp_group_reduces_gradients(group)


@needs_fsdp2
def test_fsdp2s_post_backward_node_names_its_group(sharded: dict) -> None:
    groups = {fsdp_group_of_node(node) for node in sharded["nodes"]} - {None}
    assert sharded["group"] in groups or fsdp_param_groups(sharded["model"])[0] in groups, moved(
        f"an autograd node {FSDP_POST_BACKWARD_NODE} with .param_group (FSDP2)")


@needs_fsdp2
def test_fsdp2s_post_backward_reduces_a_held_gradient(sharded: dict) -> None:
    """Gradients accumulated with reduction held off land in ``.grad`` when the post-backward
    runs: one rank, so the reduced gradient is the unsharded one."""
    model = sharded["model"]
    settings = [s for m in (model, model[0], model[2]) for s in fsdp_step_settings(m)]
    groups = [g for m in (model, model[0], model[2]) for g in fsdp_param_groups(m)]
    model.zero_grad()
    for each in settings:
        each.hold()
    try:
        x = torch.randn(5, 3, requires_grad=True)
        model(x).sum().backward()
        params = [p for g in groups for p in fsdp_group_params(g)]
        assert all(fsdp_param_received_gradient(p) for p in params)
        assert all(fsdp_sharded_param(p).grad is None for p in params)  # not reduced yet
        # held gathered: the unsharded parameters the module computes with, full-sized
        assert all(fsdp_unsharded_param(p).shape == fsdp_sharded_param(p).shape
                   and fsdp_unsharded_param(p).grad is not None for p in params)
    finally:
        for each in settings:
            each.restore()
    run_fsdp_post_backward(model, groups)
    assert all(fsdp_unsharded_param(p) is None for p in params)  # resharded
    expected = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    expected.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    expected(x.detach().requires_grad_()).sum().backward()
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        assert torch.equal(p.grad.full_tensor(), q.grad), moved(
            "FSDPParamGroup.post_backward reducing held gradients (FSDP2)")


def test_a_once_differentiable_functions_node_names_its_function() -> None:
    """``_forward_cls`` on a custom Function's node, and the one wrapper code of
    ``@once_differentiable``: what check_double_backward finds such ops by."""

    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):
            return v * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class Once(Plain):
        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):
            return g * 2

    x = torch.randn(3, requires_grad=True)
    node = Once.apply(x).grad_fn
    assert getattr(node, "_forward_cls", None) is Once, moved("BackwardCFunction._forward_cls")
    assert once_differentiable_function(node) is Once, moved(
        "one wrapper code object for every @once_differentiable backward")
    assert once_differentiable_function(Plain.apply(x).grad_fn) is None
    assert once_differentiable_function((x * 2).grad_fn) is None


def test_anomaly_mode_marks_the_nodes_a_backward_creates() -> None:
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        y = x.tanh()
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert not created_by_a_backward(y.grad_fn)
    assert created_by_a_backward(g.grad_fn), moved(
        f"the anomaly-mode metadata key {ANOMALY_PARENT_KEY!r} on nodes created by a backward")



def test_multihead_attention_calls_the_functional_modules_attention() -> None:
    fused = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return fused(*args, **kwargs)

    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    expected = attention(x, x, x, need_weights=False)[0]
    with attention_in_functional(counted):
        got = attention(x, x, x, need_weights=False)[0]
    assert calls, moved("torch.nn.functional.scaled_dot_product_attention as the attention "
                        "that F.multi_head_attention_forward calls from its body")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.nn.functional.scaled_dot_product_attention is fused


def test_a_compiled_regions_autograd_node_has_its_name() -> None:
    model = torch.compile(nn.Linear(3, 1), backend="aot_eager")
    y = model(torch.randn(2, 3, requires_grad=True))
    assert COMPILED_NODE in walk_backward_graph([y]).names(), moved(
        f"the autograd node {COMPILED_NODE!r} of a torch.compile'd region")


@needs_fsdp2
def test_fsdp2s_parameters_are_dtensors(sharded: dict) -> None:
    parameter = next(sharded["model"].parameters())
    assert isinstance(parameter, dtensor_type()), moved("DTensor as FSDP2's parameter class")


def private_torch_imports(source: str) -> list[str]:
    """The private names of torch's that ``source`` imports (a module or a name with a leading
    underscore, under ``torch``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name.split(".")[0] == "torch" and "._" in a.name]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            found += [f"{node.module}.{a.name}" for a in node.names
                      if "._" in f".{node.module}.{a.name}"]
    return found


def test_private_torch_imports_are_found() -> None:
    assert private_torch_imports("from torch.nn.modules.batchnorm import _NormBase\n"
                                 "import torch._dynamo\nfrom torch._C import foo\n"
                                 "from torch import nn\nimport torch.nn.functional as F\n") == [
        "torch.nn.modules.batchnorm._NormBase", "torch._dynamo", "torch._C.foo"]


def test_only_the_compat_module_imports_private_names_of_torch() -> None:
    root = pathlib.Path(gradreg.__file__).parent
    offenders = {str(path.relative_to(root.parent)): names
                 for path in sorted(root.rglob("*.py")) if path.name != "torch_compat.py"
                 if (names := private_torch_imports(path.read_text(encoding="utf-8")))}
    assert not offenders, f"import these through gradreg/torch_compat.py: {offenders}"
