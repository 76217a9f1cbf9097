"""One rank of :class:`gradreg.integrations.engine_penalty.EnginePenalty` on DeepSpeed's engine
(``python -m tests.penalties.ranks_engine OUT`` with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/
``MASTER_*`` and ``DS_ACCELERATOR=cpu`` set): the float32 MLP of
:func:`~tests.penalties.ranks_problem.problem` under ZeRO-2 with SGD (lr 0.1), each rank's share
of the batch of 16 in two micro-batches (``gradient_accumulation_steps=2``), one step per
penalty, and ``sam`` under ZeRO-3 (``zero3_sam``); saves the parameters after it and the
penalty's value. :func:`reference` is one process's step with the whole batch."""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from gradreg.penalties import GradientPenalty, accumulated_backward, param_grad_norm, sam
from tests.distributed import end_rank
from tests.penalties.ranks_problem import problem

LR = 0.1
PENALTIES = {"sam": lambda: sam(0.05), "gnp": lambda: param_grad_norm(0.5)}


def float_problem() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model, x, y = problem()
    return model.float(), x.float(), y


def engine_step(name: str, rank: int, world: int, stage: int = 2, micro_batches: int = 2
                ) -> tuple[torch.Tensor, torch.Tensor]:
    import deepspeed

    from gradreg.integrations.engine_penalty import EnginePenalty

    model, x, y = float_problem()
    share = len(x) // world
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": share // micro_batches,
        "gradient_accumulation_steps": micro_batches, "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    penalty = EnginePenalty(engine, PENALTIES[name]())
    penalty.penalty.due()
    for rows in torch.arange(share).chunk(micro_batches):
        penalty.backward(lambda module, rows=rows: F.cross_entropy(module(xs[rows]), ys[rows]),
                         on=(xs,))
        engine.step()
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params) if stage == 3 else nullcontext():
        return torch.cat([p.detach().flatten() for p in params]), penalty.last_value


def reference(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameters after one SGD step of one process with the whole batch in 4
    micro-batches (``accumulated_backward``), and the penalty's value."""
    model, x, y = float_problem()
    params = list(model.parameters())
    penalty: GradientPenalty = PENALTIES[name]()
    penalty.due()
    parts = [lambda rows=slice(k, k + 4): F.cross_entropy(model(x[rows]), y[rows])
             for k in range(0, 16, 4)]
    _, value = accumulated_backward(penalty, parts, params, rows=[4] * 4, on=(x,))
    return torch.cat([(p - LR * p.grad).detach().flatten() for p in params]), value


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {name: engine_step(name, rank, world) for name in PENALTIES}
    results["zero3_sam"] = engine_step("sam", rank, world, stage=3)
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_rank()
