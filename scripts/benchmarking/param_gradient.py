"""Parameter-gradient penalties (GNP, SAM) against the hand-written two-pass recipes.

For the digits MLP (64-256-256-10, tanh, batch 256) and the transformer classifier of
``benchmarking/transformer.py`` (3x32x32 images in 4x4 patches, width 64, 4 layers, 4 heads,
here with dropout 0.1, batch 32), one training step (zero_grad, forward, backward(s), SGD
update) per method:

* ``plain``: the task loss alone;
* ``hand_gnp``: Zhao et al.'s recipe written by hand, ``g = ∇L(θ)`` by ``backward``,
  ``θ' = θ + r g/‖g‖``, ``.grad = (1-α) g + α ∇L(θ')`` (no replay of dropout's mask: the
  cheapest form, and wrong under dropout);
* ``gnp_plain_form``: ``loss + param_grad_norm(LossAt.run(...), params)``, one backward (three
  backward passes);
* ``gnp``: :func:`gradreg.penalties.two_pass.penalized_loss` (two passes, the mask replayed, the
  buffers kept) and one ``backward`` of its terms;
* ``gnp_backward``: :func:`gradreg.penalties.two_pass.penalized_backward` (the same passes, the
  gradient added to ``.grad`` without a backward of the caller's);
* ``hand_sam``: davda54/sam's two steps; ``sam`` and ``sam_backward``: the two forms with
  ``sam(rho)``.

Times are process CPU time (``--clock cpu``) or wall time; the ratio of a method is the median
over rounds (:data:`ROUNDS`) of its time over the plain step's in the same round (every method
once per round, in an order shuffled per round, so that machine noise and the caches left by the
step before hit all alike); ``× hand`` is the median over rounds of the
ratio to the hand-written recipe of the same penalty. Peak memory is the tensor memory of one
step's forwards and backwards above what is alive before it
(:func:`benchmarking.timing.peak_memory`).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarking.timing import peak_memory
from gradreg import differentiable_attention
from gradreg.models import TransformerClassifier
from gradreg.penalties import param_grad_norm, sam
from gradreg.penalties.methods.param_gradient import LossAt
from gradreg.penalties.two_pass import penalized_backward, penalized_loss

WEIGHT, STEP, RHO, LR = 0.01, 0.01, 0.05, 0.01
#: rounds per case: the digits MLP's 5 ms steps vary by a few percent from round to round, so
#: its medians take more of them
ROUNDS = {"digits_mlp": 200, "transformer": 40}
#: method -> the hand-written recipe it is compared with
AGAINST = {"gnp": "hand_gnp", "gnp_backward": "hand_gnp", "gnp_plain_form": "hand_gnp",
           "sam": "hand_sam", "sam_backward": "hand_sam"}


def cases(quick: bool) -> dict[str, tuple[nn.Module, Tensor, Tensor]]:
    torch.manual_seed(0)
    if quick:
        mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 10))
        return {"mlp": (mlp, torch.randn(8, 8), torch.randint(0, 10, (8,)))}
    mlp = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                        nn.Linear(256, 10))
    vit = TransformerClassifier(image_shape=(3, 32, 32), patch=4, dim=64, depth=4, heads=4,
                                dropout=0.1)
    return {"digits_mlp": (mlp, torch.randn(256, 64), torch.randint(0, 10, (256,))),
            "transformer": (vit, torch.rand(32, 3, 32, 32), torch.randint(0, 10, (32,)))}


def hand_two_pass(model: nn.Module, loss_fn: Callable[[], Tensor], r: float,
                  alpha: float) -> None:
    """``.grad = (1-α) ∇L(θ) + α ∇L(θ + r g/‖g‖)`` as one writes it by hand (SAM: α = 1)."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss_fn().backward()
    g = [p.grad for p in params]
    norm = torch.sqrt(sum(t.square().sum() for t in g))
    shifts = [t * (r / norm) for t in g]
    with torch.no_grad():
        for p, e in zip(params, shifts, strict=True):
            p.add_(e)
    for p in params:
        p.grad = None
    loss_fn().backward()
    with torch.no_grad():
        for p, e, first in zip(params, shifts, g, strict=True):
            p.sub_(e)
            if alpha != 1:
                p.grad.mul_(alpha).add_(first, alpha=1 - alpha)


def steps(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Callable[[], None]]:
    """Each method's forwards and backwards (the optimizer's step is added by the caller)."""
    params = list(model.parameters())

    def loss_fn() -> Tensor:
        return F.cross_entropy(model(x), y)

    gnp = param_grad_norm(WEIGHT, method="finite_difference", step=STEP)
    rho = sam(RHO)

    def plain_form() -> None:
        at = LossAt.run(loss_fn, x)
        (at.loss + gnp(at, params)).backward()

    def two_pass(penalty: nn.Module) -> None:
        task, value = penalized_loss(penalty, LossAt.run(loss_fn, x), params)
        (task + value).backward()

    return {"plain": lambda: loss_fn().backward(),
            "hand_gnp": lambda: hand_two_pass(model, loss_fn, STEP, WEIGHT / STEP),
            "gnp_plain_form": plain_form,
            "gnp": lambda: two_pass(gnp),
            "gnp_backward": lambda: penalized_backward(gnp, LossAt.run(loss_fn, x), params),
            "hand_sam": lambda: hand_two_pass(model, loss_fn, RHO, 1.0),
            "sam": lambda: two_pass(rho),
            "sam_backward": lambda: penalized_backward(rho, LossAt.run(loss_fn, x), params)}


def measure(name: str, model: nn.Module, x: Tensor, y: Tensor, reps: int,
            clock: Callable[[], float]) -> list[dict]:
    runs = steps(model, x, y)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(method: str) -> float:
        optimizer.zero_grad(set_to_none=True)
        start = clock()
        runs[method]()
        optimizer.step()
        return clock() - start

    for method in runs:  # warm-up
        step(method)
    times: dict[str, list[float]] = {method: [] for method in runs}
    order, shuffle = list(runs), random.Random(0).shuffle
    for _ in range(reps):
        shuffle(order)
        for method in order:
            times[method].append(step(method))
    memory = {}
    for method in runs:
        optimizer.zero_grad(set_to_none=True)
        memory[method] = peak_memory(runs[method], torch.device("cpu"))

    def ratio(method: str, base: str) -> float:
        return statistics.median(a / b for a, b in zip(times[method], times[base], strict=True))

    return [{"case": name, "batch": len(x), "method": method,
             "median_ms": 1e3 * statistics.median(times[method]),
             "ratio": ratio(method, "plain"),
             "vs_hand": ratio(method, AGAINST[method]) if method in AGAINST else None,
             "peak_mb": memory[method] / 2**20,
             "memory_vs_hand": (memory[method] / memory[AGAINST[method]]
                                if method in AGAINST else None)}
            for method in runs]


def main(quick: bool, reps: int | None, clock: Callable[[], float]) -> list[dict]:
    rows = []
    for name, (model, x, y) in cases(quick).items():
        rows += measure(name, model, x, y, reps or (3 if quick else ROUNDS[name]), clock)
        print(table([r for r in rows if r["case"] == name]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    def cell(value: float | None, fmt: str) -> str:
        return "" if value is None else format(value, fmt)

    lines = ["| case | batch | method | median ms | × plain | × hand | peak MB | memory × hand |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['batch']} | {r['method']} | {r['median_ms']:.2f} | "
              f"{r['ratio']:.2f} | {cell(r['vs_hand'], '.3f')} | {r['peak_mb']:.2f} | "
              f"{cell(r['memory_vs_hand'], '.2f')} |" for r in rows]
    return "\n".join(lines)


#: Finite-difference steps (``step``: the shift's length r, or GR's ε) whose float32 error is
#: measured.
STEPS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
#: The penalties swept, by option: GNP's norm and GR's half squared norm (their exact gradients
#: :math:`H\hat g` and :math:`H g`), GR by each shift rule (:math:`\theta + r\hat g`,
#: :math:`\theta + \epsilon g`).
SWEPT = {"gnp": {}, "gr normalized": {"power": 2.0, "gain": 0.5},
         "gr gradient": {"power": 2.0, "gain": 0.5, "shift": "gradient"}}


def penalty_gradient(model: nn.Module, x: Tensor, y: Tensor, **options: object) -> Tensor:
    """The parameter gradient of ``param_grad_norm(1, **options)`` alone (the task's taken
    out), flat."""
    params = list(model.parameters())

    def loss_fn() -> Tensor:
        return F.cross_entropy(model(x), y)

    penalty = param_grad_norm(1.0, **options)
    with differentiable_attention() if not penalty.needs_callable else nullcontext():
        at = LossAt.run(loss_fn, x)
    value = penalty(at if penalty.needs_callable else at.loss, params)
    return torch.cat([g.flatten() for g in torch.autograd.grad(value, params)])


def errors(quick: bool) -> list[dict]:
    """The relative error of the float32 finite difference of each penalty of :data:`SWEPT` and
    each step against float64 double backward, per case (dropout off: one function), with the
    case's float32 loss-gradient norm (GR's shift is ε times it)."""
    rows = []
    for name, (model, x, y) in cases(quick).items():
        model.eval()
        model.float()
        params = list(model.parameters())
        norm = torch.sqrt(sum(g.square().sum() for g in torch.autograd.grad(
            F.cross_entropy(model(x), y), params))).item()
        for penalty, options in SWEPT.items():
            exact_options = {k: v for k, v in options.items() if k != "shift"}
            exact = penalty_gradient(model.double(), x.double(), y, **exact_options)
            model.float()
            for step in STEPS:
                estimate = penalty_gradient(model, x, y, method="finite_difference", step=step,
                                            **options)
                rows.append({"case": name, "penalty": penalty, "step": step,
                             "gradient_norm": norm,
                             "error": ((estimate.double() - exact).norm()
                                       / exact.norm()).item()})
        model.train()
    return rows


def error_table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys((r["case"], r["penalty"]) for r in rows))
    lines = ["| step r | " + " | ".join(f"{c} {p}" for c, p in columns) + " |",
             "|---:|" + "---:|" * len(columns)]
    for step in STEPS:
        cells = [next(f"{r['error']:.1e}" for r in rows
                      if (r["case"], r["penalty"]) == column and r["step"] == step)
                 for column in columns]
        lines.append(f"| {step:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
