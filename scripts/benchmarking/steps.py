"""What each benchmarked method computes in one training step of a case, and its error.

``plain``: the task loss alone. ``hand``: the straight hand-written double backward (written
here, not imported). ``exact``: :class:`gradreg.penalties.GradientPenalty` by double backward.
``lazy16``: ``every=16``. ``subsample``: ``subsample=0.25``. ``chunks``: ``chunks=4``.
``finite_difference`` and ``compiled``: those methods. ``plain_bn`` and ``exact_bn``: ``plain``
and ``exact`` on the twin of the model whose BatchNorm layers are gradreg's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from benchmarking.cases import Case
from gradreg.penalties import GradientPenalty, make_penalty

METHODS = ("plain", "plain_bn", "hand", "exact", "exact_bn", "lazy16", "subsample", "chunks",
           "finite_difference", "compiled")
#: Methods run on the twin with gradreg's BatchNorm, and the method each one runs there.
TWIN_METHODS = {"plain_bn": "plain", "exact_bn": "exact"}
#: Methods whose gradient is not the exact one by construction, or is computed another way.
APPROXIMATE = ("subsample", "chunks", "finite_difference", "compiled")


def hand_written(penalty: str, g: Tensor) -> Tensor:
    """The usual reference code: ``lambda * mean(||g|| - 1)^2`` or ``gamma/2 * mean ||g||^2``."""
    sq = g.flatten(1).square().sum(1)
    if penalty == "wgan_gp":
        return 10.0 * (g.flatten(1).norm(2, dim=1) - 1).square().mean()
    if penalty == "r1":
        return 5.0 * sq.mean()
    return sq.mean()


def penalties(case: Case) -> dict[str, GradientPenalty]:
    """The configured penalty of each gradreg method."""
    return {"exact": make_penalty(case.penalty), "lazy16": make_penalty(case.penalty, every=16),
            "subsample": make_penalty(case.penalty, subsample=0.25),
            "chunks": make_penalty(case.penalty, chunks=4),
            "finite_difference": make_penalty(case.penalty, method="finite_difference"),
            "compiled": make_penalty(case.penalty, method="compiled")}


def step_losses(case: Case, pens: dict[str, GradientPenalty]) -> dict[str, Callable[[], Tensor]]:
    """The loss of one training step for each method (the caller runs backward and the update)."""

    def hand() -> Tensor:
        p = case.points()
        loss, out = case.task_with(p)
        (g,) = torch.autograd.grad(out.sum(), p, create_graph=True)
        return loss + hand_written(case.penalty, g)

    def exact(pen: GradientPenalty) -> Tensor:
        p = case.points()
        loss, out = case.task_with(p)
        return loss + pen(out, p)

    def lazy() -> Tensor:
        return exact(pens["lazy16"]) if pens["lazy16"].due() else case.task()

    def own_forward(pen: GradientPenalty) -> Tensor:
        return case.task() + pen(case.fn, case.points(), fn_args=case.fn_args)

    def finite_difference() -> Tensor:
        if not case.shared:
            return own_forward(pens["finite_difference"])
        p = case.points()
        loss, out = case.task_with(p)
        # the forward at the points themselves is the task's: fn returns it instead of recomputing
        return loss + pens["finite_difference"](
            lambda q, *args: out if q is p else case.fn(q, *args), p, fn_args=case.fn_args)

    return {"plain": case.task, "hand": hand, "exact": lambda: exact(pens["exact"]),
            "lazy16": lazy, "subsample": lambda: own_forward(pens["subsample"]),
            "chunks": lambda: own_forward(pens["chunks"]),
            "finite_difference": finite_difference,
            "compiled": lambda: own_forward(pens["compiled"])}


def penalty_gradient(case: Case, penalty: GradientPenalty, points: Tensor,
                     outputs: Tensor | nn.Module) -> Tensor:
    """The penalty's gradient w.r.t. all parameters of the case's model, flattened."""
    params = [p for p in case.model.parameters() if p.requires_grad]
    value = penalty(outputs, points, fn_args=() if isinstance(outputs, Tensor) else case.fn_args)
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                      for p, g in zip(params, grads, strict=True)])


def exact_gradient(case: Case, points: Tensor) -> Tensor:
    return penalty_gradient(case, make_penalty(case.penalty), points,
                            case.fn(points, *case.fn_args))


def relative_errors(case: Case, pens: dict[str, GradientPenalty],
                    methods: list[str]) -> dict[str, float]:
    """|G - G_exact| / |G_exact| of the penalty's parameter gradient on the same points."""
    points = case.points()
    exact = exact_gradient(case, points)
    return {m: float((penalty_gradient(case, pens[m], points, case.fn) - exact).norm()
                     / exact.norm())
            for m in methods if m in APPROXIMATE}


def twin_error(case: Case, twin: Case) -> float:
    """The same relative error of the twin with gradreg's BatchNorm (parameters still equal)."""
    points = case.points()
    exact = exact_gradient(case, points)
    return float((exact_gradient(twin, points) - exact).norm() / exact.norm())
