"""The FSDP2 side of the parity test; ``python fsdp_run.py OUT`` is one rank (gloo, CPU).

The test starts both ranks with ``RANK``/``WORLD_SIZE``/``MASTER_PORT`` set. Every case of
``fsdp_cases.CASES`` runs inside :func:`gradreg.sharding.penalty_step`; the first-order cases
(finite differences, perturbation estimates) also without it, and the failures that the step
exists for are recorded (the raw FSDP2 error and the lost gradients of a hand-written R1, and
gradreg's refusal of its R1 preset without the step), as are the step's refusals. Rank 0 writes
one file: case name -> the full gradients (gathered from the shards), or the text of the error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_cases import CASES, LAYOUTS, WORLD, Case, critic, data, loss, step, train
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gradreg.sharding import check_penalty_graph, penalty_step, sharded_modules
from gradreg.torch_compat import fsdp_step_settings


def shard(model: nn.Module, layout: str, **options: object) -> nn.Module:
    """``fully_shard`` on every Linear and on the root, with the ``layout``'s reshard setting."""
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=layout == "default", **options)
    return fully_shard(model, reshard_after_forward=layout == "default", **options)


def full_grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]


def run(case: Case, rank: int, around: Callable = penalty_step,
        build: Callable[[Case], nn.Module] | None = None) -> object:
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    try:
        model = build(case) if build else shard(critic(case.dtype), case.layout,
                                                **({"mp_policy": mixed} if case.mixed else {}))
        step(case, model, data(rank, case.dtype), rank, around)
    except Exception as error:  # recorded for the test to check
        return f"{type(error).__name__}: {error}"
    return full_grads(model)


def plain(model: nn.Module) -> nullcontext:
    """FSDP2 on its own, as configured."""
    return nullcontext()


def raw(layout: str) -> Callable[[nn.Module], nullcontext]:
    """FSDP2 on its own; for the layout that keeps the parameters gathered, also after
    backward (``set_reshard_after_backward(False)``)."""
    def around(model: nn.Module) -> nullcontext:
        if layout != "default":
            model.set_reshard_after_backward(False)
        return nullcontext()
    return around


def hand_written_r1(layout: str, rank: int) -> object:
    """mean D(x) + mean_i ||grad_x D(x_i)||^2 written with torch.autograd.grad (no gradreg),
    on FSDP2 alone: its error, or the gradients it leaves."""
    model = shard(critic(torch.float32), layout)
    try:
        with raw(layout)(model):
            x = data(rank, torch.float32).requires_grad_()
            outputs = model(x)
            (g,) = torch.autograd.grad(outputs.sum(), x, create_graph=True)
            (outputs.mean() + g.square().sum(1).mean()).backward()
    except Exception as error:  # recorded for the test to check
        return f"{type(error).__name__}: {error}"
    return full_grads(model)


def nested(model: nn.Module) -> AbstractContextManager:
    """A step entered inside another one (kept alive on the model, as a user's would be)."""
    model.outer_step = penalty_step(model)
    model.outer_step.__enter__()
    return penalty_step(model)


def backward_outside(case: Case, rank: int) -> object:
    model = shard(critic(case.dtype), case.layout)
    try:
        with penalty_step(model):
            total = loss(case, model, data(rank, case.dtype), rank)
        total.backward()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return full_grads(model)


def settings(model: nn.Module) -> list[object]:
    """What ``penalty_step`` changes on each FSDP2 module while it holds it."""
    return [settings.current() for m in sharded_modules(model)
            for settings in fsdp_step_settings(m)]


def check_graph(case: Case, rank: int, around: Callable) -> str:
    """What :func:`check_penalty_graph` says of the critic's outputs at the points."""
    model = shard(critic(case.dtype), case.layout)
    x = data(rank, case.dtype).requires_grad_()
    try:
        with around(model):
            outputs = model(x)
            check_penalty_graph(outputs)
            outputs.sum().backward()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "passed"


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, object] = {}
    for case in CASES:
        results[case.name] = run(case, rank)
        if case.first_order:
            results["plain:" + case.name] = run(case, rank, around=plain)
    r1 = Case("r1")
    for layout in LAYOUTS:  # what FSDP2 does with a double backward on its own
        results[f"raw:{layout}"] = hand_written_r1(layout, rank)
        results[f"preset:{layout}"] = run(Case("r1", layout=layout), rank, around=raw(layout))
    for layout in LAYOUTS:  # optimizer steps: the shards are updated, gathered afresh
        model = shard(critic(torch.float32), layout)
        train(Case("wgan_gp", layout=layout), model, rank, penalty_step)
        results[f"train:{layout}"] = [p.full_tensor() for p in model.parameters()]
    for layout in LAYOUTS:  # the module's own settings and sharded parameters come back
        model = shard(critic(torch.float32), layout)
        before = settings(model)
        step(r1, model, data(rank, torch.float32), rank, penalty_step)
        results[f"restored:{layout}"] = (settings(model) == before,
                                         all(hasattr(p, "to_local") for p in model.parameters()))
    results["graph_outside"] = check_graph(r1, rank, around=plain)
    results["graph_inside"] = check_graph(r1, rank, around=penalty_step)
    results["backward_outside"] = backward_outside(r1, rank)
    results["nested"] = run(r1, rank, around=nested)
    hsdp = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    results["hsdp"] = run(r1, rank, build=lambda c: shard(critic(c.dtype), c.layout, mesh=hsdp))
    if rank == 0:
        torch.save(results, out / "fsdp.pt")
    dist.barrier()
    # gloo's threads and the failed runs' state: end here, skipping the interpreter's teardown
    # (torch 2.4 aborted there now and then; see ddp_run.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
