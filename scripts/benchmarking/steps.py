"""What each benchmarked method computes in one training step of a case, and its error.

``plain``: the task loss alone. ``hand``: the straight hand-written double backward (written
here, not imported). ``exact``: :class:`gradreg.penalties.GradientPenalty` by double backward.
``lazy16``: ``every=16``. ``subsample``: ``subsample=0.25``. ``chunks``: ``chunks=4``.
``finite_difference`` and ``perturbation`` (R1 and double backprop only): those
methods. ``plain_bn`` and ``exact_bn``: ``plain`` and ``exact`` on the twin of the model whose
BatchNorm layers are gradreg's. For the Hessian penalty ``exact`` is its exact form and
``finite_difference`` the authors' central difference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from benchmarking.cases import Case
from gradreg.penalties import GradientPenalty, make_penalty

METHODS = ("plain", "plain_bn", "hand", "exact", "exact_bn", "lazy16", "subsample", "chunks",
           "finite_difference", "perturbation")
#: Methods run on the twin with gradreg's BatchNorm, and the method each one runs there.
TWIN_METHODS = {"plain_bn": "plain", "exact_bn": "exact"}
#: Methods whose gradient is not the exact one by construction, or is computed another way.
APPROXIMATE = ("subsample", "chunks", "finite_difference", "perturbation")


def hand_written(penalty: str, g: Tensor) -> Tensor:
    """The usual reference code: ``lambda * mean(||g|| - 1)^2`` or ``gamma/2 * mean ||g||^2``."""
    sq = g.flatten(1).square().sum(1)
    if penalty == "wgan_gp":
        return 10.0 * (g.flatten(1).norm(2, dim=1) - 1).square().mean()
    if penalty == "r1":
        return 5.0 * sq.mean()
    return sq.mean()


def gradreg_options(case: Case) -> dict[str, dict]:
    """The options of the case's preset that make each gradreg method of the case. The
    perturbation estimate applies to squared target-0 norms (R1, double backprop); the Hessian
    penalty has two methods, exact (``exact``, ``lazy16``) and the authors' central difference
    (``finite_difference``)."""
    if case.penalty == "hessian":
        return {"exact": {"method": "double_backward"},
                "lazy16": {"method": "double_backward", "every": 16},
                "finite_difference": {"method": "finite_difference"}}
    options = {"exact": {}, "lazy16": {"every": 16}, "subsample": {"subsample": 0.25},
               "chunks": {"chunks": 4}, "finite_difference": {"method": "finite_difference"}}
    if case.penalty in ("r1", "double_backprop"):
        options["perturbation"] = {"method": "perturbation"}
    return options


def applicable(case: Case, methods: tuple[str, ...]) -> tuple[str, ...]:
    """The ``methods`` that apply to ``case``: the plain step, the hand-written double backward of
    gradient norms, the twins, and the gradreg methods of :func:`gradreg_options`."""
    gradreg = gradreg_options(case)
    return tuple(m for m in methods if m in gradreg or m in TWIN_METHODS or m == "plain"
                 or (m == "hand" and case.penalty != "hessian"))


def penalties(case: Case) -> dict[str, GradientPenalty]:
    """The configured penalty of each gradreg method that applies to the case."""
    return {m: make_penalty(case.penalty, **options)
            for m, options in gradreg_options(case).items()}


def step_losses(case: Case, pens: dict[str, GradientPenalty]) -> dict[str, Callable[[], Tensor]]:
    """The loss of one training step for each method (the caller runs backward and the update)."""

    def hand() -> Tensor:
        p = case.points()
        loss, out = case.task_with(p)
        (g,) = torch.autograd.grad(out.sum(), p, create_graph=True)
        return loss + hand_written(case.penalty, g)

    def with_penalty(pen: GradientPenalty) -> Tensor:
        """The task plus the penalty, sharing the task's forward at the points where the math
        allows: double backward differentiates it; finite differences, the perturbation
        estimate and the Hessian penalty get a callable that hands it back at the points
        themselves; subsample and chunks run their own forward."""
        p = case.points()
        if not pen.needs_callable:
            loss, out = case.task_with(p)
            return loss + pen(out, p)
        config = pen.config
        if case.shared and config.subsample == 1 and config.chunks == 1:
            loss, out = case.task_with(p)
            return loss + pen(lambda q, *args: out if q is p else case.fn(q, *args), p,
                              fn_args=case.fn_args)
        return case.task() + pen(case.fn, p, fn_args=case.fn_args)

    def lazy() -> Tensor:
        return with_penalty(pens["lazy16"]) if pens["lazy16"].due() else case.task()

    losses = {"plain": case.task, "hand": hand, "lazy16": lazy}
    return losses | {m: (lambda pen=pen: with_penalty(pen)) for m, pen in pens.items()
                     if m != "lazy16"}


def penalty_gradient(case: Case, penalty: GradientPenalty, points: Tensor,
                     outputs: Tensor | nn.Module) -> Tensor:
    """The penalty's gradient w.r.t. all parameters of the case's model, flattened."""
    params = [p for p in case.model.parameters() if p.requires_grad]
    torch.manual_seed(0)  # the same random directions and probes for every method
    value = penalty(outputs, points, fn_args=() if isinstance(outputs, Tensor) else case.fn_args)
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                      for p, g in zip(params, grads, strict=True)])


def exact_gradient(case: Case, points: Tensor) -> Tensor:
    exact = make_penalty(case.penalty, **gradreg_options(case)["exact"])
    return penalty_gradient(case, exact, points, case.fn if exact.needs_callable
                            else case.fn(points, *case.fn_args))


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
