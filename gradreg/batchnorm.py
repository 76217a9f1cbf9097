r"""BatchNorm with a cheap exact double backward: a drop-in for ``nn.BatchNorm1d/2d/3d``.

A gradient penalty differentiates the input gradient, so one backward of ``loss + penalty`` runs
the *double backward* of every op. torch's BatchNorm double backward (``batchnorm_double_backward``,
``CudnnBatchNormBackwardBackward0`` on a GPU) is composed of about ninety small ops per layer.
Here it is written out in closed form: five per-channel reductions and a few elementwise ops.

Per channel, with :math:`M` elements, :math:`\mu` and :math:`\sigma^2` the batch mean and biased
variance, :math:`r = (\sigma^2 + \epsilon)^{-1/2}`, :math:`\hat x = (x - \mu) r`, sums :math:`S`
over the channel's elements and :math:`y = w \hat x + b`:

* forward and first backward are torch's own kernels (``native_batch_norm`` and its backward):
  :math:`\nabla_x = r w\,\Pi g`, :math:`\nabla_w = S(g \hat x)`, :math:`\nabla_b = S(g)` for the
  output gradient :math:`g`, where :math:`\Pi a = a - S(a)/M - \hat x\, S(a \hat x)/M` is
  symmetric, and :math:`\partial \hat x / \partial x = r\Pi`, :math:`\nabla_x r = -r^2 \hat x/M`;
* the double backward: for cotangents :math:`v, v_w, v_b` of :math:`(\nabla_x, \nabla_w,
  \nabla_b)`, the scalar :math:`L = \langle v, \nabla_x\rangle + v_w S(g\hat x) + v_b S(g)` has

  .. math::

      \partial L/\partial g &= r w\,\Pi v + v_w \hat x + v_b, \qquad
      \partial L/\partial w = r\,(S(gv) - S(g)S(v)/M - S(g\hat x)S(v\hat x)/M), \\
      \partial L/\partial x &= r\,\Pi h - Q r^2 \hat x / M, \quad
      h = -\tfrac{r w}{M}\,(v\, S(g\hat x) + g\, S(v\hat x)) + v_w g, \quad
      Q = w\,(S(gv) - S(g)S(v)/M - S(g\hat x)S(v\hat x)/M),

  (:math:`L` through :math:`\hat x` with :math:`r` held, plus through :math:`r`), in which
  :math:`S(h)` and :math:`S(h\hat x)` follow from the five sums :math:`S(g), S(v), S(g\hat x),
  S(v\hat x), S(gv)`, so each gradient is one per-channel affine combination of :math:`v, g,
  \hat x`. Where the double backward itself runs with ``create_graph=True`` (third derivatives),
  :math:`\mu, r` are recomputed from :math:`x` in the graph, so every order stays exact.

Eval mode (running statistics) is the affine map :math:`y = x \cdot w r + (b - \mu w r)`, written as
one differentiable ``addcmul``, whose double backward is a product or two.

Half-precision inputs (autocast) keep torch's behaviour: statistics and gradients are computed in
float32, outputs and input gradients have the input's dtype. Running statistics are updated by
the same kernel as torch's (unbiased variance, ``momentum=None`` as a cumulative average).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gradreg.torch_compat import BatchNormBase

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "batch_norm", "convert_batchnorm"]


def _channel(t: Tensor, like: Tensor) -> Tensor:
    """A per-channel vector [C] as [1, C, 1, ...], broadcastable against ``like``."""
    return t.view((1, -1) + (1,) * (like.ndim - 2))


def _mean(t: Tensor) -> Tensor:
    """Per-channel mean E = S/M over every dim but 1, as [1, C, 1, ...]."""
    return t.mean([d for d in range(t.ndim) if d != 1], keepdim=True)


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _native_backward(g: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, invstd: Tensor,
                     eps: float) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """torch's fused training-mode BatchNorm backward: (grad_x, grad_w, grad_b)."""
    affine = weight is not None
    return torch.ops.aten.native_batch_norm_backward(
        g, x, weight, None, None, mean, invstd, True, eps, [True, affine, affine])


class _BatchNormBackward(torch.autograd.Function):
    """``(g, x, w) -> (grad_x, grad_w, grad_b)`` of training-mode BatchNorm: forward is torch's
    fused kernel, backward the closed form of the module docstring."""

    @staticmethod
    def forward(ctx, g: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, invstd: Tensor,
                eps: float) -> tuple[Tensor, Tensor | None, Tensor | None]:
        ctx.save_for_backward(g, x, weight, mean, invstd)
        ctx.eps = eps
        return _native_backward(g, x, weight, mean, invstd, eps)

    @staticmethod
    def backward(ctx, v: Tensor, v_w: Tensor | None,
                 v_b: Tensor | None) -> tuple[Tensor | None, ...]:
        g, x, weight, mean, invstd = ctx.saved_tensors
        dtype = _compute_dtype(x)
        xs, gs, vs = x.to(dtype), g.to(dtype), v.to(dtype)
        if torch.is_grad_enabled():  # create_graph: the statistics as functions of x
            var, mu = torch.var_mean(xs, [d for d in range(x.ndim) if d != 1], correction=0,
                                     keepdim=True)
            r = torch.rsqrt(var + ctx.eps)
        else:
            mu, r = _channel(mean, x), _channel(invstd, x)
        w, vw, vb = (1.0, 0.0, 0.0) if weight is None else (
            _channel(weight, x).to(dtype), _channel(v_w, x), _channel(v_b, x))
        xhat = (xs - mu) * r
        # the five sums of the module docstring, as means E = S/M
        e_g, e_v, e_gx, e_vx, e_gv = (_mean(gs), _mean(vs), _mean(gs * xhat), _mean(vs * xhat),
                                      _mean(gs * vs))
        inner = e_gv - e_g * e_v - e_gx * e_vx  # <v, Π g> / M
        rw = r * w
        c = vw - rw * e_vx  # h = a v + c g, and the coefficient of xhat in grad_g
        a = -rw * e_gx
        e_h, e_hx = a * e_v + c * e_g, a * e_vx + c * e_gx  # S(h)/M, S(h xhat)/M
        # per-channel affine combinations of v, g, xhat; the full-size tensor first in each op
        # (addcmul with a broadcast first operand is 2-3x slower on CPU)
        grad_g = torch.addcmul((xhat * c).add_(vb - rw * e_v), vs, rw)
        # r (h - S(h)/M - xhat S(h xhat)/M) - Q r^2 xhat / M, Q = w <v, Π g>
        grad_x = (xhat * (-r * (e_hx + w * inner * r))).add_(-r * e_h)
        grad_x = torch.addcmul(torch.addcmul(grad_x, vs, r * a), gs, r * c)
        grad_w = None if weight is None else (
            (r * inner).flatten() * (xs.numel() / xs.shape[1])).to(weight.dtype)
        return grad_g.to(g.dtype), grad_x.to(x.dtype), grad_w, None, None, None


class _BatchNormTrain(torch.autograd.Function):
    """Training-mode BatchNorm (batch statistics): torch's kernels forward and backward; the
    backward is :class:`_BatchNormBackward`, so its own backward is the closed form."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                running_mean: Tensor | None, running_var: Tensor | None, momentum: float,
                eps: float) -> Tensor:
        out, mean, invstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var,
                                                    True, momentum, eps)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        # with create_graph, a backward whose own backward is the closed form; else just torch's
        backward = _BatchNormBackward.apply if torch.is_grad_enabled() else _native_backward
        grad_x, grad_w, grad_b = backward(g, x, weight, mean, invstd, ctx.eps)
        return grad_x, grad_w, grad_b, None, None, None, None


def batch_norm(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
               weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``torch.nn.functional.batch_norm`` with the closed-form double backward (module docstring).

    ``training``: normalize with the batch statistics (and update the running ones in place,
    when given, with ``momentum``); otherwise with the running statistics.
    """
    if training:
        if input.numel() // input.shape[1] <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"size {list(input.shape)}")
        return _BatchNormTrain.apply(input, weight, bias, running_mean, running_var, momentum,
                                     eps)
    scale = torch.rsqrt(running_var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -running_mean * scale
    if bias is not None:
        shift = shift + bias
    return torch.addcmul(_channel(shift, input), input, _channel(scale, input)).to(input.dtype)


class _ExactBatchNorm(BatchNormBase):
    """torch's ``_BatchNorm`` (same parameters, buffers, state-dict keys and running-statistics
    rule) whose forward is :func:`batch_norm`."""

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        return batch_norm(input, self.running_mean if keep else None,
                          self.running_var if keep else None, self.weight, self.bias,
                          batch_stats, factor, self.eps)


class BatchNorm1d(_ExactBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` with the closed-form double backward."""


class BatchNorm2d(_ExactBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` with the closed-form double backward."""


class BatchNorm3d(_ExactBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` with the closed-form double backward."""


_REPLACEMENTS = {nn.BatchNorm1d: BatchNorm1d, nn.BatchNorm2d: BatchNorm2d,
                 nn.BatchNorm3d: BatchNorm3d}


def convert_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` (recursively, or ``module`` itself)
    by gradreg's, like ``nn.SyncBatchNorm.convert_sync_batchnorm``: the same parameter and buffer
    tensors (an optimizer built before keeps working), training flag, device and dtype. Returns
    the converted module; ``model = gradreg.convert_batchnorm(model)``. Only those three exact
    types are replaced: subclasses (``SyncBatchNorm``, lazy or user-defined ones, whose forward
    may differ) are left as they are.
    """
    cls = _REPLACEMENTS.get(type(module))
    out = module
    if cls is not None:
        out = cls(module.num_features, module.eps, module.momentum, module.affine,
                  module.track_running_stats, device="meta")
        for name, value in [*module.named_parameters(recurse=False),
                            *module.named_buffers(recurse=False)]:
            setattr(out, name, value)
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_batchnorm(child))
    return out
