"""One rank of :class:`gradreg.integrations.engine_penalty.EnginePenalty` under DeepSpeed ZeRO-3,
whose finite differences run on each rank's partitions
(:class:`gradreg.integrations.zero_sharded.ShardedStep`): ``python -m
tests.penalties.ranks_zero_sharded OUT`` with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*``
and ``DS_ACCELERATOR=cpu`` set. A float32 MLP with dropout, each rank's share of a batch of 16
in two micro-batches (``gradient_accumulation_steps=2``), two SGD steps per case (:data:`CASES`:
the penalty, ``sam``, ``gr`` or the finite-difference ``param_grad_norm``; the parameters
partitioned or all kept gathered by ZeRO-3's persistence threshold; gradient clipping; the
penalty of the last layer alone); saves the parameters after them and the last step's penalty
value. :func:`reference` is one process taking both steps with the whole batch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gradreg.penalties import GradientPenalty, accumulated_backward, gr, param_grad_norm, sam
from tests.distributed import end_rank

LR, STEPS, MICRO_BATCHES, ROWS = 0.1, 2, 2, 16
#: gr's shift eps g with eps = 1e-2: at its default eps (3e-4 in float32) and weight 0.5 the
#: quotient's factor, weight / eps, multiplies the float32 rounding of the two gradients (summed
#: over ranks here, over micro-batches in the reference) to 5.5e-6 of the parameters (measured)
PENALTIES = {"sam": lambda: sam(0.05), "gr": lambda: gr(0.5, step=1e-2),
             "gnp": lambda: param_grad_norm(0.5, method="finite_difference", step=1e-2)}
#: case -> (penalty, ZeRO-3's persistence threshold: 0 partitions every parameter, its default
#: keeps these small ones gathered; gradient clipping's norm, 0 for none; whether the penalty is
#: of the last layer's parameters alone, the others taking the task's gradient)
CASES = {"sam": ("sam", 0, 0.0, False), "gr": ("gr", 0, 0.0, False), "gnp": ("gnp", 0, 0.0, False),
         "sam_persistent": ("sam", 10**5, 0.0, False), "gr_persistent": ("gr", 10**5, 0.0, False),
         "sam_clipped": ("sam", 0, 0.05, False), "sam_last_layer": ("sam", 0, 0.0, True)}


def problem(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 3))
    return model.to(dtype), torch.randn(ROWS, 4).to(dtype), torch.randint(0, 3, (ROWS,))


def seed(step: int, micro_batch: int) -> int:
    """The seed of the dropout masks of the step's ``micro_batch``-th micro-batch of the whole
    batch (rank r's k-th is the whole batch's r * MICRO_BATCHES + k-th)."""
    return 1000 + 10 * step + micro_batch


def engine_step(case: str, rank: int, world: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The parameters after the steps, the last step's penalty value, and whether every
    step's penalty left the rank's partitions, and the parameters held gathered when the step
    began (the persistent ones after the first forward), bitwise as they were then."""
    import deepspeed

    from gradreg.integrations.engine_penalty import EnginePenalty

    name, persistence, clipping, last_layer = CASES[case]
    model, x, y = problem()
    share = ROWS // world
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": share // MICRO_BATCHES,
        "gradient_accumulation_steps": MICRO_BATCHES, "gradient_clipping": clipping,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persistence},
        "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    penalty = EnginePenalty(engine, PENALTIES[name](),
                            list(model[-1].parameters()) if last_layer else None)
    assert penalty.sharded is not None
    params, restored = list(model.parameters()), True
    for step in range(STEPS):
        penalty.penalty.due()
        before = [(p.ds_tensor.clone(), p.data.clone()) for p in params]
        for k, rows in enumerate(torch.arange(share).chunk(MICRO_BATCHES)):
            torch.manual_seed(seed(step, rank * MICRO_BATCHES + k))  # replayed by the penalty
            penalty.backward(lambda module, rows=rows: F.cross_entropy(module(xs[rows]),
                                                                       ys[rows]), on=(xs,))
            if k == MICRO_BATCHES - 1:  # the penalty's passes ran: before the optimizer's step
                restored &= all(torch.equal(part, p.ds_tensor) and (
                    data.numel() == 0 or torch.equal(data, p.data)) for p, (part, data)
                    in zip(params, before, strict=True))
            engine.step()
    with deepspeed.zero.GatheredParameters(params):
        return (torch.cat([p.detach().flatten() for p in params]), penalty.last_value,
                torch.tensor(restored))


def reference(case: str, world: int = 2, *, penalized: bool = True,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The parameters after ``STEPS`` SGD steps of one process with the whole batch in
    ``world * MICRO_BATCHES`` micro-batches (``accumulated_backward``, each micro-batch's
    forward seeded as on its rank), clipped as DeepSpeed clips (the gradient divided by
    ``(norm + 1e-6) / clipping`` where that is above 1), and the last step's penalty value;
    not ``penalized``: the task's gradient alone (no value); in ``dtype``."""
    name, _, clipping, last_layer = CASES[case]
    model, x, y = problem(dtype)
    params = list(model.parameters())
    chosen = (list(model[-1].parameters()) if last_layer else params) if penalized else []
    penalty: GradientPenalty = PENALTIES[name]()
    size = ROWS // (world * MICRO_BATCHES)
    value = None
    for step in range(STEPS):
        penalty.due()

        def part(m: int, step: int = step) -> torch.Tensor:
            torch.manual_seed(seed(step, m))
            rows = slice(m * size, (m + 1) * size)
            return F.cross_entropy(model(x[rows]), y[rows])

        parts = [lambda m=m: part(m) for m in range(world * MICRO_BATCHES)]
        if chosen:
            _, value = accumulated_backward(penalty, parts, chosen,
                                            rows=[size] * len(parts), on=(x,))
        others = [p for p in params if all(p is not q for q in chosen)]
        if others:  # the task's gradient alone
            grads = torch.autograd.grad(sum(fn() for fn in parts) / len(parts), others)
            for p, g in zip(others, grads, strict=True):
                p.grad = g
        with torch.no_grad():
            grads = [p.grad for p in params]
            if clipping > 0:
                total = torch.cat([g.flatten() for g in grads]).norm()
                ratio = (total + 1e-6) / clipping
                if ratio > 1:
                    torch._foreach_div_(grads, ratio)
            torch._foreach_add_(params, grads, alpha=-LR)
        for p in params:
            p.grad = None
    return torch.cat([p.detach().flatten() for p in params]), value


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.save({case: engine_step(case, rank, world) for case in CASES}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_rank()
