r"""How a penalty's parameter gradient is computed (``double_backward``, ``finite_difference``,
``compiled``), and the cost levers that keep the method (``subsample``, lazy ``every``).

Notation: per-sample outputs :math:`f_i`, points :math:`x_i`, input gradients
:math:`g_i = \nabla_{x_i} \sum_j f_j`, the unweighted penalty :math:`P(g)` (a function of the
gradients only, built by :class:`~gradreg.penalties.GradientPenalty`), parameters :math:`\theta`.
By the chain rule, with :math:`v_i = \partial P / \partial g_i` held fixed,

.. math::

    \nabla_\theta P = \sum_i H_{\theta x_i} v_i
                    = \nabla_\theta \sum_i \langle \nabla_{x_i} f_i, v_i \rangle ,

a mixed second derivative. ``double_backward`` gets it exactly by differentiating the graph of
:math:`g` (reverse over reverse); the two other methods return the exact value of :math:`P` plus a
zero-valued surrogate :math:`S - \operatorname{detach}(S)` whose parameter gradient is the
estimate, so ``(task + penalty).backward()`` works unchanged. Only parameter gradients are
estimated; the gradient the surrogate sends to the points themselves is not meaningful.

| method            | work on top of the task step           | error of the parameter gradient   |
|-------------------|----------------------------------------|-----------------------------------|
| double_backward   | input backward with graph + its        | exact                             |
|                   | backward (about 2x a plain step)       |                                   |
| finite_difference | input backward, forward + backward at  | O(eps) + O(u/eps) when smooth;    |
|                   | shifted points (about 2.3x in FLOPs)   | O(1) piecewise-linear (refused)   |
| compiled          | its own forward, compiled torch.func   | exact (float rounding)            |

``chunks`` keeps double backward (exact) and trades kernel size and two parameter-sized buffers
for the memory of the penalty's graph: it is built and differentiated one micro-batch at a time
(:func:`in_chunks`).

Measured ratios are in ``docs/benchmarks.md`` (``scripts/benchmark.py``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value

from gradreg.autograd import GradientError, gradient
from gradreg.graph import graph_leaves, graph_node_names, walk_backward_graph
from gradreg.penalties.checks import check_per_sample
from gradreg.penalties.norms import per_sample_norm

__all__ = [
    "METHODS",
    "PIECEWISE_LINEAR",
    "STEPS",
    "TF32_ROUNDOFF",
    "CompiledPenalty",
    "check_independent_samples",
    "check_smooth",
    "cuda_float32_roundoff",
    "default_step",
    "finite_difference",
    "in_chunks",
    "lazy_optimizer_kwargs",
    "subsample",
    "unit_roundoff",
    "with_gradients",
]

METHODS = ("double_backward", "finite_difference", "compiled")

#: Backward-node name prefixes of the ops whose derivative jumps (activations, max pooling, clamp,
#: abs, max/min): a finite difference across a kink has an O(1) error.
PIECEWISE_LINEAR = (
    "Relu", "LeakyRelu", "RreluWithNoise", "PreluKernel", "Hardtanh", "Threshold", "Hardswish",
    "Hardsigmoid", "Hardshrink", "Softshrink", "MaxPool", "AdaptiveMaxPool", "Clamp", "Abs",
    "Maximum", "Minimum", "Max", "Min", "Amax", "Amin",
)

PenaltyOfGradients = Callable[[tuple[Tensor, ...]], Tensor]
PenaltyOfPoints = Callable[[tuple[Tensor, ...], tuple[Tensor, ...]], Tensor]
PerSampleFunction = Callable[..., Tensor]


def _broadcast(per_sample: Tensor, like: Tensor) -> Tensor:
    return per_sample.view((-1,) + (1,) * (like.ndim - 1))


#: Unit roundoff of TF32 (10 explicit mantissa bits), which cuDNN convolutions use for float32 on
#: Ampere and newer GPUs by default (``torch.backends.cudnn.allow_tf32``), and cuBLAS matmuls
#: where ``torch.get_float32_matmul_precision()`` is ``"high"``.
TF32_ROUNDOFF = 2.0**-11

#: The finite-difference step for the unit roundoff of the arithmetic: float64, float32, TF32.
#: Chosen by sweeps of the parameter gradient's error against float64 double backward on tanh,
#: softplus, ELU and SiLU MLPs, CNNs and DCGAN-style critics (TF32 emulated on the CPU by rounding
#: the operands of every convolution and matmul, forward and backward, to 10 mantissa bits).
STEPS = {2.0**-53: 1e-6, 2.0**-24: 1e-2, TF32_ROUNDOFF: 0.5}

_CONVOLUTIONS = ("Convolution", "CudnnConvolution")
_MATMULS = ("Mm", "Addmm", "Bmm", "Baddbmm", "Addbmm", "Addmv", "Mv", "Dot", "Linear")


def unit_roundoff(outputs: Tensor) -> float:
    """The unit roundoff of the arithmetic that computed ``outputs``, as it actually ran.

    That of the dtype, except under autocast, that of the autocast dtype (the model ran in it even
    where the outputs, a loss, are float32), and for float32 on CUDA, where TF32 may stand in
    (:func:`cuda_float32_roundoff` with torch's current flags; only there is the graph walked).
    """
    device = outputs.device.type
    if torch.is_autocast_enabled(device):
        return torch.finfo(torch.get_autocast_dtype(device)).eps / 2
    if device != "cuda" or outputs.dtype != torch.float32:
        return torch.finfo(outputs.dtype).eps / 2
    return cuda_float32_roundoff(graph_node_names([outputs]),
                                 conv_tf32=torch.backends.cudnn.allow_tf32,
                                 matmul_precision=torch.get_float32_matmul_precision())


def cuda_float32_roundoff(names: set[str], *, conv_tf32: bool, matmul_precision: str) -> float:
    """The unit roundoff of float32 CUDA work whose backward graph holds the nodes ``names``:
    TF32's (2**-11) where it holds convolutions and ``conv_tf32``
    (``torch.backends.cudnn.allow_tf32``, on by default) or matmuls and ``matmul_precision``
    (``torch.get_float32_matmul_precision()``) is ``"high"``; bf16's (2**-8) for matmuls at
    ``"medium"``; else float32's (2**-24)."""
    roundoff = 2.0**-24
    if matmul_precision != "highest" and any(name.startswith(_MATMULS) for name in names):
        roundoff = TF32_ROUNDOFF if matmul_precision == "high" else 2.0**-8
    if conv_tf32 and any(name.startswith(_CONVOLUTIONS) for name in names):
        roundoff = max(roundoff, TF32_ROUNDOFF)
    return roundoff


def default_step(roundoff: float) -> float:
    r"""The finite-difference step (the input-space length of each sample's shift) for
    arithmetic of unit roundoff ``roundoff`` (:func:`unit_roundoff`), from :data:`STEPS`.

    It balances truncation :math:`O(\text{eps})` against rounding :math:`O(u/\text{eps})`:
    1e-6 in float64, 1e-2 in float32, 0.5 in TF32, whose rounding noise is 8192 times float32's.
    Coarser arithmetic (bf16, fp16, bf16 matmuls) is refused: it loses all digits.
    """
    for unit, step in sorted(STEPS.items()):
        if roundoff <= unit:
            return step
    raise GradientError(
        f"finite differences in arithmetic of unit roundoff {roundoff:.1e} (bf16/fp16, autocast, "
        "or float32 matmul precision 'medium') lose all digits to rounding: run the penalty in "
        "float32 or float64 (disable autocast around it), or use method='double_backward'."
    )


def finite_difference(
    fn: PerSampleFunction,
    inputs: tuple[Tensor, ...],
    penalty_of_grads: PenaltyOfGradients,
    *,
    eps: float | None = None,
    check: bool = True,
) -> Tensor:
    r"""Exact :math:`P`, whose parameter gradient is a forward difference (no double backward).

    With :math:`v_i = \partial P/\partial g_i` and a per-sample step
    :math:`h_i = \text{eps}/\lVert v_i \rVert` (each sample moves by ``eps`` in input space),

    .. math::

        S = \sum_i \frac{f_i(x_i + h_i v_i) - f_i(x_i)}{h_i}, \qquad
        \nabla_\theta S = \sum_i H_{\theta x_i} v_i + O(\text{eps})
                        = \nabla_\theta P + O(\text{eps}).

    Any target, power, norm order, sidedness and reduction enter only through :math:`v`, which is
    the (cheap, first-order) gradient of ``penalty_of_grads`` at the detached :math:`g`. Cost: the
    forward at :math:`x`, one backward to the inputs only, a forward and a backward at the shifted
    points; the backward at :math:`x` is shared with whatever else uses ``fn``'s graph. To share
    the forward at :math:`x` with the task loss too, let ``fn`` return the task's outputs when
    called on the points themselves: ``lambda q: losses if q is x else loss_fn(model(q), y)``.

    Error: relative :math:`O(\text{eps})` (third derivatives) plus :math:`O(u/\text{eps})`
    (rounding, :math:`u` the unit roundoff of the arithmetic as it ran, :func:`unit_roundoff`);
    with :func:`default_step`, measured 1e-4 to 1e-3 in float32 and 2e-8 to 6e-8 in float64 on
    tanh/softplus/ELU networks with unit-scale inputs (up to 8e-3 on a softplus conv critic), and
    4e-3 to 6e-2 in TF32, the default of float32 convolutions on Ampere and newer GPUs (emulated
    on the CPU; docs/benchmarks.md). For the float32 error there, turn TF32 off
    (``torch.backends.cudnn.allow_tf32 = False``); for an exact gradient use double backward.
    On piecewise-linear models the parameter gradient jumps where a unit changes sign between
    :math:`x` and :math:`x + hv`, which happens with probability :math:`O(h)` and costs
    :math:`O(1/h)`: an :math:`O(1)` error that a smaller step does not remove: with ``check``
    the graph of the outputs at :math:`x` is searched and such models are refused
    (:func:`check_smooth`). Samples must not interact: BatchNorm in training mode is refused
    (:func:`check_independent_samples`).
    """
    outputs = fn(*inputs)
    check_per_sample(outputs, inputs)
    if check:
        check_smooth(outputs)
        check_independent_samples(outputs, "method='finite_difference'")
    grads = gradient(outputs, inputs, grad_outputs=torch.ones_like(outputs), create_graph=False,
                     retain_graph=True)
    with torch.enable_grad():
        leaves = tuple(g.detach().requires_grad_() for g in grads)
        value = penalty_of_grads(leaves)
        directions = torch.autograd.grad(value, leaves)
    step = default_step(unit_roundoff(outputs)) if eps is None else eps
    norms = per_sample_norm(directions)
    moving = norms > 0
    h = torch.where(moving, step / torch.where(moving, norms, 1.0), 0.0)
    shifted = tuple(x.detach() + _broadcast(h, v) * v
                    for x, v in zip(inputs, directions, strict=True))
    delta = (fn(*shifted) - outputs).reshape(len(norms), -1).sum(1)
    surrogate = (delta * torch.where(moving, norms / step, 0.0)).sum()
    return value.detach() + (surrogate - surrogate.detach())


def check_smooth(outputs: Tensor) -> None:
    """Raise where the graph of ``outputs`` holds an op whose derivative jumps
    (:data:`PIECEWISE_LINEAR`: ``nn.ReLU`` and ``F.relu`` alike, max pooling, clamp, abs...):
    there a finite difference is off by O(1), and a smaller step does not help."""
    ops = sorted({name.split("Backward")[0] for name in graph_node_names([outputs])
                  if name.startswith(PIECEWISE_LINEAR)})
    if ops:
        raise GradientError(
            f"method='finite_difference' on a piecewise-linear model ({', '.join(ops)} in its "
            "graph): where a unit changes sign between x and the shifted point the estimate is "
            "off by O(1), and a smaller step does not help. Use method='double_backward' (or "
            "'compiled'), or a smooth activation (softplus, elu, tanh, gelu, silu)."
        )


def check_independent_samples(outputs: Tensor, method: str) -> None:
    """Raise where the graph of ``outputs`` holds BatchNorm in training mode (torch's, whose node
    saves ``training``, or gradreg's): its outputs depend on the whole batch, so a penalty that
    runs the model on part of the batch (``subsample``, ``chunks``) or on shifted points with
    per-sample steps (``finite_difference``) would compute another penalty, and its extra forward
    would update the running statistics again."""
    coupled = sorted({name for node in walk_backward_graph([outputs]).nodes
                      if "BatchNorm" in (name := type(node).__name__)
                      and "BackwardBackward" not in name  # forward nodes say the mode
                      and getattr(node, "_saved_training", True)})
    if coupled:
        raise GradientError(
            f"{method} runs the model on part of the batch or on shifted points, but its graph "
            f"holds BatchNorm in training mode ({', '.join(coupled)}), whose outputs depend on "
            "the whole batch: the penalty would change, and the running statistics would be "
            "updated again. Use the exact penalty on the task's forward (method="
            "'double_backward', subsample=1, chunks=1), BatchNorm in eval mode, or a per-sample "
            "normalization (GroupNorm, LayerNorm)."
        )


class CompiledPenalty:
    r"""The exact penalty and :math:`\nabla_\theta P` of one module by compiled ``torch.func``.

    ``torch.compile`` does not support double backward through a compiled model (aot_autograd
    raises); composing ``torch.func.grad`` (inputs) inside ``grad_and_value`` (parameters) of a
    ``functional_call`` and compiling the whole is exact and supported. The parameter gradient
    :math:`G` enters the caller's backward through the surrogate
    :math:`\sum_\theta \langle \theta, \operatorname{detach}(G) \rangle` minus its detached value.
    The forward at the points runs inside (it is not shared with a task loss), so it is slower
    than eager double backward wherever measured (CPU 2.1-3.7x a plain step against 2.0-2.3x;
    H100 1.01-1.25x eager double backward): it is refused on CUDA, and on models with
    normalization layers in training mode (their in-place running-statistics update fails to
    compile; eval mode works). The first call
    compiles (tens of seconds on CPU; a C++ compiler is needed there); where compiling fails the
    call warns once and returns ``None`` from then on, and the caller falls back to
    ``double_backward``. Each new input shape recompiles (the smaller last batch: use
    ``drop_last``); all instances share one compiled code object, so past dynamo's
    ``recompile_limit`` (8) compilations in a process the calls run uncompiled (still exact).
    """

    def __init__(self, module: nn.Module, penalty_of_grads: PenaltyOfGradients) -> None:
        if not isinstance(module, nn.Module):
            raise GradientError(
                f"method='compiled' needs outputs as an nn.Module called on the points (got "
                f"{type(module).__name__}): its parameters are passed to torch.func explicitly. "
                "Wrap the per-sample function in a module."
            )
        updating = [name for name, m in module.named_modules()
                    if isinstance(m, nn.modules.batchnorm._NormBase) and m.training
                    and m.track_running_stats]
        if updating:
            raise GradientError(
                f"method='compiled' cannot run {', '.join(repr(n) for n in updating)}: "
                "normalization layers in training mode update their running statistics in "
                "place, which torch.func under torch.compile does not support. Use "
                "method='double_backward' (exact, and faster on every case measured), or put "
                "those layers in eval mode."
            )
        self.module = module
        self.available = True

        def penalty(params: dict[str, Tensor], buffers: dict[str, Tensor],
                    args: tuple[Tensor, ...], *points: Tensor) -> Tensor:
            def total(*xs: Tensor) -> Tensor:
                return functional_call(module, (params, buffers), xs + args).sum()

            return penalty_of_grads(grad(total, argnums=tuple(range(len(points))))(*points))

        self._compiled = torch.compile(grad_and_value(penalty))

    def __call__(self, inputs: tuple[Tensor, ...],
                 args: tuple[Tensor, ...] = ()) -> Tensor | None:
        """The penalty at the points ``inputs``; ``args``: the module's further per-sample
        arguments (not differentiated). None where compiling failed."""
        if inputs[0].device.type == "cuda":
            raise GradientError(
                "method='compiled' is not offered on CUDA: on an H100 (torch 2.11) it took "
                "1.01-1.25x the time of eager double backward on every case measured, since it "
                "runs its own forward and cannot share the task's. Use method='double_backward' "
                "(exact)."
            )
        if not self.available:
            return None
        params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        buffers = dict(self.module.named_buffers())
        detached = {n: p.detach() for n, p in params.items()}
        try:
            grads, value = self._compiled(detached, buffers, args,
                                          *(x.detach() for x in inputs))
        except Exception as err:  # compiler missing or backend failure: fall back, say why
            self.available = False
            warnings.warn(
                f"method='compiled' is unavailable here ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}); falling back to "
                "method='double_backward' (exact, uncompiled).",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        return with_gradients(value, list(params.values()), [grads[n] for n in params])


def with_gradients(value: Tensor, tensors: list[Tensor], gradients: list[Tensor]) -> Tensor:
    r"""``value`` (detached) plus a zero whose gradient w.r.t. each ``tensors[j]`` is
    ``gradients[j]``: :math:`v + S - \operatorname{detach}(S)`,
    :math:`S = \sum_j \langle t_j, \operatorname{detach}(G_j) \rangle`.

    Hands gradients computed ahead of time to the caller's one ``backward`` (scaled by whatever
    multiplies the value there). First order only: its own gradient is constant.
    """
    surrogate = sum((t * g.detach()).sum() for t, g in zip(tensors, gradients, strict=True))
    if not isinstance(surrogate, Tensor):  # nothing to carry
        return value.detach()
    return value.detach() + (surrogate - surrogate.detach())


def in_chunks(
    penalty_of_points: PenaltyOfPoints,
    inputs: tuple[Tensor, ...],
    chunks: int,
    *,
    args: tuple[Tensor, ...] = (),
    mean: bool,
    loss_scale: float | Tensor | None = None,
) -> Tensor:
    r"""A per-sample penalty evaluated ``chunks`` micro-batches at a time; exact, less memory.

    For a penalty that is a mean (``mean=True``) or a sum of per-sample terms, split the batch of
    :math:`B` samples into micro-batches :math:`c` of :math:`B_c` samples:

    .. math::

        P = \sum_c w_c P_c, \quad w_c = B_c / B \text{ (mean) or } 1 \text{ (sum)}, \qquad
        \nabla_\theta P = \sum_c w_c \nabla_\theta P_c .

    Each :math:`P_c` = ``penalty_of_points(points_c, args_c)`` (its own forward at fresh leaves
    that are the micro-batch's points, with the micro-batch's rows of the per-sample ``args``
    such as labels, and its double-backward graph) is differentiated at once by
    ``torch.autograd.grad`` w.r.t. every leaf it depends on (the parameters) and, where the points
    come from upstream computation (a generator), w.r.t. the points; then its graph is freed. The
    sums of these exact gradients reach the caller's single ``backward`` through
    :func:`with_gradients`. So ``.grad`` is that of the unchunked penalty, to float rounding,
    while at most one micro-batch's double-backward graph is alive: the memory of the penalty's
    graph falls by about ``chunks``, for the price of up to two parameter-sized buffers (the
    running sum and one micro-batch's gradient). The products computed are those of the same
    penalty run unchunked on its own forward (WGAN-GP's interpolates), in smaller kernels; a
    penalty that could have shared the task's forward (R1 on the reals, double backprop) pays
    one more forward and backward. Samples must not interact (BatchNorm in training mode is
    refused); leaf points receive no gradient (as with :func:`gradreg.regularized_backward`).
    Under a ``loss_scale`` (fp16) each micro-batch is differentiated scaled and unscaled after,
    like the penalty itself.
    """
    batch = inputs[0].shape[0]
    upstream = [x.grad_fn is not None for x in inputs]
    values: list[Tensor] = []
    leaf_grads: dict[int, tuple[Tensor, Tensor]] = {}
    point_grads: list[list[Tensor]] = [[] for _ in inputs]
    pieces = max(1, min(chunks, batch))  # an empty batch reaches the penalty's own error
    for part in zip(*(x.tensor_split(pieces) for x in inputs + args), strict=True):
        points = tuple(x.detach().requires_grad_() for x in part[:len(inputs)])
        value = penalty_of_points(points, part[len(inputs):]) * (
            len(points[0]) / batch if mean else 1.0)
        mine = {id(x) for x in points}
        leaves = [t for t in graph_leaves([value]) if id(t) not in mine]
        wanted = leaves + [x for x, up in zip(points, upstream, strict=True) if up]
        if loss_scale is None:
            grads = torch.autograd.grad(value, wanted, allow_unused=True)
        else:
            grads = tuple(None if g is None else g / loss_scale for g in
                          torch.autograd.grad(value * loss_scale, wanted, allow_unused=True))
        grads = [torch.zeros_like(t) if g is None else g
                 for t, g in zip(wanted, grads, strict=True)]
        for leaf, g in zip(leaves, grads[:len(leaves)], strict=True):
            if id(leaf) in leaf_grads:
                leaf_grads[id(leaf)][1].add_(g)  # in place: one buffer per leaf
            else:  # an expanded view (stride 0) cannot be added to in place
                leaf_grads[id(leaf)] = (leaf, g.contiguous())
        rest = iter(grads[len(leaves):])
        for collected, up in zip(point_grads, upstream, strict=True):
            if up:
                collected.append(next(rest))
        values.append(value.detach())
    tensors = [t for t, _ in leaf_grads.values()] + [x for x, up in zip(inputs, upstream,
                                                                        strict=True) if up]
    gradients = [g for _, g in leaf_grads.values()] + [torch.cat(c) for c in point_grads if c]
    return with_gradients(sum(values), tensors, gradients)


def subsample(inputs: tuple[Tensor, ...], fraction: float) -> tuple[Tensor, ...]:
    r"""The first :math:`k = \lceil \text{fraction} \cdot B \rceil` samples of every input.

    StyleGAN2's batch shrink. With a batch in random order the penalty of the subset is an
    unbiased estimate of the batch's for ``reduction="mean"`` (the caller rescales a sum by
    :math:`B/k`), with variance growing as :math:`1/k`; the cost of the penalty shrinks by about
    ``fraction``.
    """
    if fraction >= 1:
        return inputs
    k = max(1, math.ceil(fraction * inputs[0].shape[0]))
    return tuple(x[:k] for x in inputs)


def lazy_optimizer_kwargs(
    lr: float, betas: tuple[float, float] = (0.9, 0.999), every: int = 1
) -> dict[str, float | tuple[float, float]]:
    r"""StyleGAN2's optimizer correction for a penalty taken as its own step every ``every``.

    Over ``every`` minibatches the optimizer then takes ``every + 1`` steps; with
    :math:`c = k/(k+1)` the corrected settings are ``lr * c`` and ``betas ** c``, which keeps the
    learning rate per minibatch and the moment decay per minibatch as without the extra steps.
    Not needed when the penalty is added to the task loss on the due step (one step either way).
    """
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an int >= 1, got {every!r}.")
    ratio = every / (every + 1)
    return {"lr": lr * ratio, "betas": (betas[0] ** ratio, betas[1] ** ratio)}
