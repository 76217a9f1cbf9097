r"""The exact method: the penalty of per-sample outputs by double backward.

:class:`ExactPenalty` is what the methods are given as ``exact``
(:class:`~gradreg.penalties.call.PenaltyFunctions`): for outputs :math:`f` computed from
points :math:`x_i`, the per-sample norms :math:`n_i = \lVert g_i \rVert_p` of
``config.projection`` (:mod:`gradreg.penalties.formulas.projections`; squared where the
configuration's ``squared`` says so), built with ``create_graph=True``, and the unweighted penalty
of the norms,
:math:`\operatorname{reduce}_i \phi(n_i - c)^{\text{power}}`
(:class:`~gradreg.penalties.formulas.norms.NormPenalty`), whose parameter gradient is the exact
double backward one. The target :math:`c` is the configured number or, with ``target="ema"``, the
running mean :math:`a` after this batch's update
(:class:`~gradreg.penalties.state.running_mean.RunningMean`).

It holds the checks of its own calls: per-sample outputs on every call; FSDP2-sharded modules in
the graph (:func:`~gradreg.sharding.check_penalty_graph`) on the first call, and on every call
once there were any; on the first call, that the norms have a double backward
(:func:`~gradreg.autograd.check_double_backward`) and, with ``subsample`` or ``chunks``, that the
samples do not interact (:func:`~gradreg.penalties.guards.coupling.check_independent_samples`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torch import Tensor

from gradreg import sharding
from gradreg.attention import differentiable_attention, explain_fused_attention
from gradreg.autograd import GradientError, check_double_backward
from gradreg.penalties.call import Configuration, Method, PenaltyCall, PenaltyFunctions
from gradreg.penalties.formulas.norms import NormPenalty
from gradreg.penalties.formulas.projections import PROJECTIONS
from gradreg.penalties.guards.compiled import check_not_compiled
from gradreg.penalties.guards.coupling import check_independent_samples
from gradreg.penalties.guards.options import Option, require
from gradreg.penalties.methods.chunks import InChunks
from gradreg.penalties.state.loss_scale import LossScale
from gradreg.penalties.state.running_mean import RunningMean

__all__ = ["DoubleBackward", "DoubleBackwardMethod", "ExactPenalty"]


class ExactPenalty:
    r"""The unweighted penalty of per-sample ``outputs`` w.r.t. the points ``inputs``,
    differentiable by double backward (module docstring), called as
    ``exact(outputs, inputs, loss_scale)``.

    ``of_norms``: the penalty as a function of the norms and a target; ``running_mean``: the
    target of ``config.target == "ema"``.

    Examples:
        R1's unweighted penalty, :math:`\mathrm{mean}_i \lVert w \rVert^2`, of a linear critic:

        >>> import torch
        >>> from gradreg.penalties import PenaltyConfig
        >>> from gradreg.penalties.methods.double_backward import ExactPenalty
        >>> from gradreg.penalties.state.running_mean import RunningMean
        >>> from gradreg.penalties.formulas.norms import NormPenalty
        >>> config = PenaltyConfig.from_flat(points="real")
        >>> exact = ExactPenalty(config, NormPenalty(target=0.0, squared=True),
        ...                      RunningMean({"ema": torch.zeros(())}, "ema", decay=0.01))
        >>> x = torch.randn(4, 2, requires_grad=True)
        >>> exact(x @ torch.tensor([3.0, 4.0]), (x,), None)
        tensor(25.)
    """

    def __init__(self, config: Configuration, of_norms: NormPenalty,
                 running_mean: RunningMean) -> None:
        self.config, self.of_norms, self.running_mean = config, of_norms, running_mean
        norm = config.norm
        self.norms = partial(PROJECTIONS[norm.projection], p=norm.p, squared=norm.squared,
                             order=norm.order, count=norm.count, per_sample=config.per_sample)
        self.target = norm.target
        self._checked = False  # the first call's checks passed
        self._through_sharded = False  # FSDP2 modules in the graph: checked on every call

    def __call__(self, outputs: Tensor, inputs: tuple[Tensor, ...],
                 loss_scale: LossScale) -> Tensor:
        config = self.config
        if not self._checked or self._through_sharded:
            self._through_sharded = sharding.check_penalty_graph(outputs)
        norms = self.norms(outputs, inputs, loss_scale=loss_scale)
        if not self._checked:
            check_double_backward(norms, outputs)
            chunks = getattr(config.method, "chunks", 1)
            if config.subsample < 1 or chunks > 1:
                check_independent_samples(
                    outputs, inputs, f"subsample={config.subsample}, chunks={chunks}")
            self._checked = True
        target = self.running_mean.update(norms) if self.target == "ema" else self.target
        return self.of_norms(norms, target)


@dataclass(frozen=True, eq=False)
class DoubleBackward(Option):
    """``method="double_backward"``: the exact parameter gradient, by differentiating the graph
    of the input gradient; ``chunks`` micro-batches at a time where ``chunks > 1``
    (:class:`~gradreg.penalties.methods.chunks.InChunks`: the same gradient, about ``1/chunks``
    of the penalty graph's peak memory).

    Examples:
        >>> from gradreg.penalties.methods import DoubleBackward
        >>> DoubleBackward(chunks=4).name, DoubleBackward(chunks=4) == DoubleBackward(4)
        ('double_backward', True)
        >>> DoubleBackward(chunks=0)
        Traceback (most recent call last):
        ...
        ValueError: chunks must be an int >= 1 (1 = the whole batch at once), got 0.
    """

    name = "double_backward"

    chunks: int = 1

    def __post_init__(self) -> None:
        chunks = self.chunks
        require(isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1,
                f"chunks must be an int >= 1 (1 = the whole batch at once), got {chunks!r}")

    def check(self, config: Configuration) -> None:
        """Refuse chunks of a penalty whose samples are coupled (an ``"ema"`` target, one norm
        over the parameters)."""
        require(self.chunks == 1 or (config.norm.numeric_target and config.per_sample),
                f"chunks={self.chunks} needs method='double_backward', a numeric target (an 'ema' "
                "target couples the samples) and per-sample points; use chunks=1")

    def build(self, config: Configuration, penalty: PenaltyFunctions) -> Method:
        if self.chunks > 1:
            return InChunks(penalty, self.chunks, mean=config.norm.reduction == "mean")
        return DoubleBackwardMethod(penalty)


class DoubleBackwardMethod:
    """Exact: the penalty of the outputs (given, or the callable's), by double backward. The
    callable runs inside :func:`~gradreg.attention.differentiable_attention` (fused attention
    kernels have no double backward)."""

    def __init__(self, penalty: PenaltyFunctions) -> None:
        self.penalty = penalty
        self._checked = False

    def __call__(self, call: PenaltyCall) -> Tensor:
        if call.fn is None:  # the outputs of the caller's forward
            outputs = call.outputs
            call.check(outputs)
        else:
            with differentiable_attention():
                outputs = call.evaluate()
        if not self._checked:  # a torch.compile'd model: refused on the first call
            check_not_compiled(outputs)
            self._checked = True
        try:
            return self.penalty.exact(outputs, call.inputs, call.loss_scale)
        except GradientError as err:  # the outputs computed outside differentiable attention
            explained = explain_fused_attention(err)
            if explained is err:
                raise
            raise explained from err
