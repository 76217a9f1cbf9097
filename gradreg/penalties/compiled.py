"""The exact penalty and its parameter gradient through compiled ``torch.func``; the refusal of
a double backward through a compiled model."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value

from gradreg.autograd import GradientError
from gradreg.graph import walk_backward_graph
from gradreg.penalties.chunks import with_gradients
from gradreg.torch_compat import COMPILED_NODE

__all__ = ["CompileUnavailable", "CompiledPenalty", "check_not_compiled", "runs_compiled"]

#: The penalties that need no double backward, which run on a torch.compile'd model.
WITHOUT_DOUBLE_BACKWARD = (
    "method='perturbation' (approx_r1, approx_r2, double backprop and the Jacobian with "
    "target 0), method='finite_difference' (input-gradient penalties with a numeric target; "
    "param_grad_norm given the loss as LossAt), or kind='hessian' by its finite difference")


def runs_compiled(outputs: Tensor) -> bool:
    """Whether the graph of ``outputs`` runs through a compiled region (``torch.compile``).
    Such a region's backward is compiled on its first use, and where that backward keeps no
    graph it donates its saved buffers: every later backward of the region that retains the
    graph (``retain_graph`` or ``create_graph``) raises. A method that needs two backwards of
    a compiled forward runs the forward once more instead, one backward each."""
    return outputs.grad_fn is not None and COMPILED_NODE in walk_backward_graph([outputs]).names()


def check_not_compiled(outputs: Tensor) -> None:
    """Raise where the graph of ``outputs`` runs through a compiled region: torch's
    compiled autograd has no double backward (aot_autograd raises, or ``chunks`` fails on its
    donated buffers), so an exact penalty cannot differentiate it twice."""
    if runs_compiled(outputs):
        raise GradientError(
            "an exact penalty (double backward) of a torch.compile'd model: compiled autograd "
            "has no double backward. Use a method that needs none on the compiled model, "
            f"{WITHOUT_DOUBLE_BACKWARD}; or compute the penalty's forward with the uncompiled "
            "module (model._orig_mod for torch.compile(model)), which double backward "
            "differentiates exactly.")

PenaltyOfGradients = Callable[[tuple[Tensor, ...]], Tensor]


class CompileUnavailable(RuntimeError):
    """``torch.compile`` failed here (no C++ compiler, a backend failure); the message says why."""


class CompiledPenalty:
    r"""The exact penalty and :math:`\nabla_\theta P` of one module by compiled ``torch.func``.

    ``torch.compile`` does not support double backward through a compiled model (aot_autograd
    raises); composing ``torch.func.grad`` (inputs) inside ``grad_and_value`` (parameters) of a
    ``functional_call`` and compiling the whole is exact and supported. The parameter gradient
    :math:`G` enters the caller's backward through the surrogate
    :math:`\sum_\theta \langle \theta, \operatorname{detach}(G) \rangle` minus its detached value.
    The forward at the points runs inside (it is not shared with a task loss), so it was slower
    than eager double backward on every case measured (``docs/benchmarks.md``): it is refused on
    CUDA, and on models with normalization layers in training mode (their in-place running-
    statistics update fails to compile; eval mode works). The first call compiles (tens of seconds
    on CPU; a C++ compiler is needed there); where compiling fails the call raises
    :class:`CompileUnavailable`, on which :class:`~gradreg.penalties.methods.Compiled` falls back
    to ``double_backward`` for good. Each new input shape recompiles (the smaller last batch: use
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
                    if m.training and getattr(m, "track_running_stats", False)]
        if updating:
            raise GradientError(
                f"method='compiled' cannot run {', '.join(repr(n) for n in updating)}: "
                "normalization layers in training mode update their running statistics in "
                "place, which torch.func under torch.compile does not support. Use "
                "method='double_backward' (exact, and faster on every case measured), or put "
                "those layers in eval mode."
            )
        self.module = module

        def penalty(params: dict[str, Tensor], buffers: dict[str, Tensor],
                    args: tuple[Tensor, ...], *points: Tensor) -> Tensor:
            def total(*xs: Tensor) -> Tensor:
                return functional_call(module, (params, buffers), xs + args).sum()

            return penalty_of_grads(grad(total, argnums=tuple(range(len(points))))(*points))

        self._compiled = torch.compile(grad_and_value(penalty))

    def __call__(self, inputs: tuple[Tensor, ...],
                 args: tuple[Tensor, ...] = ()) -> Tensor:
        """The penalty at the points ``inputs``; ``args``: the module's further per-sample
        arguments (not differentiated). Raises :class:`CompileUnavailable` where compiling
        fails."""
        if inputs[0].device.type == "cuda":
            raise GradientError(
                "method='compiled' is not offered on CUDA: it runs its own forward and cannot "
                "share the task's, and was slower than eager double backward on every case "
                "measured. Use method='double_backward' (exact)."
            )
        params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        buffers = dict(self.module.named_buffers())
        detached = {n: p.detach() for n, p in params.items()}
        try:
            grads, value = self._compiled(detached, buffers, args,
                                          *(x.detach() for x in inputs))
        except Exception as err:  # compiler missing or backend failure: say why
            reason = str(err).splitlines()[0] if str(err) else ""
            raise CompileUnavailable(f"{type(err).__name__}: {reason}") from err
        return with_gradients(value, list(params.values()), [grads[n] for n in params])

