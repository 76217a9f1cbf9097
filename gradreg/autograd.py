"""Differentiation helpers around :func:`torch.autograd.grad`, with errors that say what to do.

Everything here returns gradients as tensors and never writes ``.grad`` (``autograd.grad`` does not
accumulate into leaves, unlike ``Tensor.backward``). With ``create_graph=True`` (the default here)
the returned gradient carries its own graph, so a penalty built from it can be backpropagated to
the parameters: one ``backward`` of ``loss + penalty`` then gives d(loss + penalty)/dθ.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from gradreg.graph import walk_backward_graph
from gradreg.torch_compat import once_differentiable_function

__all__ = [
    "GradientError",
    "NonFiniteError",
    "as_tuple",
    "capture",
    "check_double_backward",
    "gradient",
    "nth_derivative",
    "regularized_backward",
]

_FREED_GRAPH = "Trying to backward through the graph a second time"
# Node names that autograd puts into the graph of a gradient where an op has no double backward.
_NO_DOUBLE_BACKWARD_NODES = {"NotImplemented", "Error"}
_NO_DOUBLE_BACKWARD_FIX = (
    "use a penalty method that needs no double backward (method='finite_difference', or "
    "method='perturbation' for squared norms with target 0: approx_r1, approx_r2), or replace the "
    "op by one that supports double backward (e.g. a plain torch implementation of a custom "
    "autograd.Function marked @once_differentiable).")


class GradientError(RuntimeError):
    """A gradient cannot be taken as asked; the message names the cause and the fix."""


class NonFiniteError(GradientError):
    """A penalty's points, outputs or value are NaN or Inf: corrupt data, or a model that
    overflowed or diverged (raised by the penalties' ``check_finite``)."""


def as_tuple(tensors: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    """One tensor or a sequence of them, as a tuple: what every function here that takes
    "tensor(s)" works on."""
    return (tensors,) if isinstance(tensors, Tensor) else tuple(tensors)


def _check_inputs(inputs: tuple[Tensor, ...]) -> None:
    if not inputs:
        raise GradientError("no inputs given: pass the tensor(s) to differentiate against.")
    for i, x in enumerate(inputs):
        if not isinstance(x, Tensor):
            raise GradientError(f"input {i} is a {type(x).__name__}, not a tensor.")
        if not (x.is_floating_point() or x.is_complex()):
            raise GradientError(
                f"input {i} has dtype {x.dtype}: only floating-point tensors have gradients. "
                "Convert it before the forward pass, e.g. x = x.float().requires_grad_()."
            )
        if not x.requires_grad:
            raise GradientError(
                f"input {i} (shape {tuple(x.shape)}) does not require grad, so nothing was "
                "recorded against it. Call x.requires_grad_() (on a detached copy for data: "
                "x = x.detach().requires_grad_()) before the forward pass that uses it."
            )


def _check_outputs(outputs: tuple[Tensor, ...], grad_outputs: tuple[Tensor, ...] | None) -> None:
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        mode = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise GradientError(
            f"gradient called under {mode}: a gradient penalty needs autograd. Wrap the forward "
            "and the penalty in `with torch.enable_grad():` (in Lightning validation, also set "
            "Trainer(inference_mode=False))."
        )
    for i, y in enumerate(outputs):
        if y.is_inference():
            raise GradientError(
                f"output {i} was created under torch.inference_mode() and has no graph. Compute it "
                "outside inference mode (Lightning: Trainer(inference_mode=False))."
            )
        if not y.requires_grad:
            raise GradientError(
                f"output {i} does not require grad: it was computed under torch.no_grad() or from "
                "tensors that do not require grad. Compute it with grad enabled, from inputs that "
                "called requires_grad_()."
            )
        if grad_outputs is None and y.numel() != 1:
            raise GradientError(
                f"grad can be implicitly created only for scalar outputs, but output {i} has shape "
                f"{tuple(y.shape)}. Pass grad_outputs=torch.ones_like(output) to differentiate "
                "the sum of its elements (per-sample gradients for independent samples), or "
                "reduce it to a scalar first."
            )


def gradient(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    *,
    grad_outputs: Tensor | Sequence[Tensor] | None = None,
    create_graph: bool = True,
    retain_graph: bool | None = None,
) -> Tensor | tuple[Tensor, ...]:
    r"""Vector-Jacobian product ``sum_k grad_outputs[k] * d outputs[k] / d inputs``.

    For a scalar output this is the gradient :math:`\nabla_x y`; with
    ``grad_outputs=ones_like(y)`` it is :math:`\nabla_x \sum_i y_i`, which for independent samples
    stacks the per-sample gradients :math:`\nabla_{x_i} y_i`.

    Args:
        outputs: tensor(s) to differentiate; non-scalars need ``grad_outputs``.
        inputs: tensor(s) that ``outputs`` was computed from: leaves, interpolates or intermediate
            activations (see :func:`capture`). All must be floating point and require grad.
        grad_outputs: the vector(s) of the vector-Jacobian product, shaped like ``outputs``.
        create_graph: keep the graph of the gradient so that a function of it (a penalty) can be
            differentiated again; ``True`` by default since that is what penalties need.
        retain_graph: keep the forward graph for another backward; defaults to ``create_graph``.

    Returns:
        One tensor shaped like ``inputs`` if ``inputs`` is a tensor, else a tuple. No ``.grad``
        attribute anywhere is read or written.

    Raises:
        GradientError: inputs that do not require grad or are not floating point, outputs without
            a graph (``no_grad``/``inference_mode``), a non-scalar output without
            ``grad_outputs``, an output that does not depend on an input (the input is named),
            or a graph already freed by an earlier backward. Torch's message is kept as the cause.
    """
    single = isinstance(inputs, Tensor)
    inputs_t = (inputs,) if single else tuple(inputs)
    outputs_t = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
    grad_outputs_t = (None if grad_outputs is None else (grad_outputs,)
                      if isinstance(grad_outputs, Tensor) else tuple(grad_outputs))
    _check_inputs(inputs_t)
    _check_outputs(outputs_t, grad_outputs_t)
    try:
        grads = torch.autograd.grad(
            outputs_t,
            inputs_t,
            grad_outputs=grad_outputs_t,
            create_graph=create_graph,
            retain_graph=retain_graph,
            allow_unused=True,
        )
    except RuntimeError as err:
        if _FREED_GRAPH in str(err):
            raise GradientError(
                "the graph of these outputs was already freed by an earlier backward or "
                "gradient call. Pass retain_graph=True to the first call (or "
                "create_graph=True, which retains it), or recompute the forward pass. "
                f"Torch said: {err}"
            ) from err
        raise
    for g in grads:  # a loop, not a comprehension: no call on the way of every penalty
        if g is None:
            unused = [i for i, g in enumerate(grads) if g is None]
            shapes = ", ".join(f"input {i} (shape {tuple(inputs_t[i].shape)})" for i in unused)
            raise GradientError(
                f"the outputs do not depend on {shapes}: it is not in their graph. "
                "Differentiate against the tensor that was actually fed to the model (not a "
                "copy made before or after the forward pass), or drop it from the inputs."
            )
    return grads[0] if single else grads


def nth_derivative(y: Tensor, x: Tensor, n: int) -> Tensor:
    r"""The ``n``-th derivative: :math:`d_0 = y`, :math:`d_k = \partial(\sum d_{k-1})/\partial x`.

    For a function applied elementwise (``y_i`` depends on ``x_i`` only) this is the elementwise
    n-th derivative, e.g. ``x**7`` at 1 gives 7, 42, 210 for n = 1, 2, 3. The graph is kept, so the
    result can be penalized or differentiated again. An order at which the derivative no longer
    depends on ``x`` (a polynomial of lower degree) gives zeros, which is exact.
    """
    if not isinstance(n, int) or n < 0:
        raise GradientError(f"n must be a non-negative int, got {n!r}.")
    derivative = y
    for order in range(1, n + 1):
        if order > 1 and not derivative.requires_grad:
            return torch.zeros_like(x)
        derivative = gradient(derivative, x, grad_outputs=torch.ones_like(derivative))
    return derivative


@contextmanager
def capture(module: nn.Module, *names: str) -> Iterator[dict[str, Tensor]]:
    """Record the outputs of the named submodules during forward passes inside the block.

    The yielded dict maps each dotted name (as in ``module.named_modules()``) to the output of its
    latest call, a non-leaf tensor inside the graph, so that gradients can be taken w.r.t.
    intermediate activations (``gradient(loss, captured["linear1"])``). Hooks are removed on exit,
    also when the block raises.

    The rest of the forward pass gets a copy of a captured tensor output (``output.clone()``,
    whose derivative is the identity), so an in-place op after the submodule
    (``ReLU(inplace=True)``, ``out += identity`` in a residual block, ``x.add_()``) modifies
    the copy: the captured tensor stays the submodule's output, and the gradient dy/dh is taken at
    that output, not at what the in-place op made of it (which would, e.g., keep
    the gradient of units that a later in-place ReLU zeroes). The copy costs one tensor of the
    output's size per captured submodule. A tuple, list or dict output has its tensors copied
    (one level deep); other outputs are passed on as they are.
    """
    if not names:
        raise ValueError("capture needs at least one submodule name.")
    modules = dict(module.named_modules())
    unknown = [name for name in names if name not in modules]
    if unknown:
        valid = ", ".join(repr(n) for n in modules if n) or "(none: the module has no children)"
        raise ValueError(f"unknown submodule name(s) {unknown}; valid names are: {valid}.")
    captured: dict[str, Tensor] = {}

    def recorder(name: str):
        def hook(_module: nn.Module, _args: object, output: object) -> object:
            captured[name] = output
            return _copy_for_the_rest(output)

        return hook

    handles = [modules[name].register_forward_hook(recorder(name)) for name in names]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def _copy_for_the_rest(output: object) -> object:
    """What the rest of the forward gets in place of a captured ``output``: a copy of each tensor
    (``clone``, derivative the identity), so that its in-place ops leave ``output`` as recorded;
    ``None`` (keep the output) for anything without tensors one level deep."""
    if isinstance(output, Tensor):
        return output.clone()
    if type(output) is dict:
        return {key: _clone(value) for key, value in output.items()}
    if isinstance(output, (tuple, list)):
        items = [_clone(item) for item in output]
        if isinstance(output, tuple) and hasattr(output, "_fields"):  # a namedtuple
            return type(output)(*items)
        return type(output)(items)
    return None


def _clone(x: object) -> object:
    return x.clone() if isinstance(x, Tensor) else x


def check_double_backward(gradients: Tensor | Sequence[Tensor],
                          outputs: Tensor | Sequence[Tensor] = ()) -> None:
    r"""Raise if the graph of ``gradients`` (from ``create_graph=True``) cannot be backpropagated
    exactly.

    Ops without a double backward leave ``NotImplemented`` or ``Error`` nodes in the graph of the
    gradient; the error would otherwise surface only at the optimizer's backward pass. Where such a
    node is found, one trial backward is run to get torch's own message, which names the op.
    ``outputs``: what ``gradients`` are the gradient of; their graph is searched for custom
    ``autograd.Function``\ s whose backward is marked ``@once_differentiable``, which leave no
    such node where their incoming gradient is a constant (at the model's output) and whose
    second derivative would then be dropped without an error
    (:func:`gradreg.torch_compat.once_differentiable_function`).
    """
    outputs = [y for y in as_tuple(outputs) if y.grad_fn is not None]
    once = sorted({function.__name__ for node in walk_backward_graph(outputs).nodes
                   if (function := once_differentiable_function(node)) is not None})
    if once:
        raise GradientError(
            f"the model contains an op without a double backward: {', '.join(once)} is an "
            "autograd.Function whose backward is marked @once_differentiable, so the penalty's "
            "gradient w.r.t. the parameters would miss its second derivative. Fix: "
            f"{_NO_DOUBLE_BACKWARD_FIX}"
        )
    grads = [g for g in as_tuple(gradients) if g.grad_fn is not None]
    graph = walk_backward_graph(grads)
    if not graph.names() & _NO_DOUBLE_BACKWARD_NODES:
        return
    probe = sum(g.sum() for g in grads)
    try:
        torch.autograd.grad(probe, graph.leaves(), retain_graph=True, allow_unused=True)
    except RuntimeError as err:
        raise GradientError(
            f"the model contains an op without a double backward, so the penalty's gradient "
            f"cannot be backpropagated. Torch said: {err}. Fix: {_NO_DOUBLE_BACKWARD_FIX}"
        ) from err


def regularized_backward(
    loss: Tensor, penalties: Iterable[Tensor], parameters: Iterable[Tensor]
) -> Tensor:
    """Zero the parameters' gradients, then one backward of ``loss + sum(penalties)``.

    Afterwards each ``p.grad`` holds exactly d(loss + sum(penalties))/dp: nothing stale from an
    earlier step (``.grad`` accumulates across backward calls unless reset) and nothing counted
    twice. The graphs of the loss and of the penalties' gradients are freed by this backward.
    Only ``parameters`` receive gradients (``backward(inputs=...)``): the gradient w.r.t. the
    penalty's points, which no one reads, is not computed, which saves the first layer's input
    matmul in both the forward graph and the double-backward graph (about 10% of an MLP's
    penalty step). Returns the detached total. The loss and every penalty must be scalars.

    Raises :class:`GradientError` where no given parameter requires grad (none given, or all
    frozen): ``backward`` would then fill the ``.grad`` of every leaf of the graph, parameters
    that were not given included; and where neither the loss nor any penalty requires grad
    (computed under ``torch.no_grad()``, or detached), where torch would say only that "element
    0 of tensors does not require grad".
    """
    penalties = list(penalties)
    for what, value in [("the loss", loss)] + [(f"penalties[{i}]", p)
                                               for i, p in enumerate(penalties)]:
        if not isinstance(value, Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise GradientError(
                f"{what} has shape {shape}, but regularized_backward adds scalars: reduce it "
                "first, e.g. a gradient f to f.square().sum() (or the penalty of a "
                "gradreg.penalties preset, which is a scalar)."
            )
    parameters = list(parameters)
    for i, parameter in enumerate(parameters):
        if not isinstance(parameter, Tensor):
            raise GradientError(f"parameters[{i}] is a {type(parameter).__name__}, not a tensor: "
                                "pass model.parameters() (or a list of tensors).")
    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        what = (f"all {len(parameters)} parameters given are frozen (requires_grad=False)"
                if parameters else "no parameters were given")
        raise GradientError(
            f"{what}: there is nothing to take gradients for, and a backward without them would "
            "write .grad into every leaf of the graph. Pass the parameters to train (e.g. "
            "[p for p in model.parameters() if p.requires_grad]), or skip the step.")
    detached = [what for what, value in [("the loss", loss)] + [
        (f"penalties[{i}]", p) for i, p in enumerate(penalties)] if not value.requires_grad]
    if len(detached) == 1 + len(penalties):
        raise GradientError(
            f"{' and '.join(detached)} {'does' if len(detached) == 1 else 'do'} not require "
            "grad, so there is nothing to backpropagate: compute the loss from the model's "
            "outputs with grad enabled (not under torch.no_grad() or inference_mode, not "
            "detached or .item()), or skip the step.")
    for parameter in parameters:
        parameter.grad = None
    total = loss
    for penalty in penalties:
        total = total + penalty
    total.backward(inputs=trainable)
    return total.detach()
