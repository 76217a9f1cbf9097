r"""The exact penalty of per-sample outputs, and StyleGAN2's running mean of the norms.

:class:`ExactPenalty` is what the methods are given as ``exact``
(:class:`~gradreg.penalties.methods.PenaltyFunctions`): for outputs :math:`f` computed from
points :math:`x_i`, the per-sample norms :math:`n_i = \lVert g_i \rVert_p` of
``config.projection`` (:mod:`gradreg.penalties.projections`; squared where the configuration's
``squared`` says so), built with ``create_graph=True``, and the unweighted penalty of the norms,
:math:`\operatorname{reduce}_i \phi(n_i - c)^{\text{power}}`
(:class:`~gradreg.penalties.norms.NormPenalty`), whose parameter gradient is the exact double
backward one. The target :math:`c` is the configured number or, with ``target="ema"``, the
running mean :math:`a` after this batch's update (:class:`RunningMean`).

It holds the checks of its own calls: per-sample outputs on every call; FSDP2-sharded modules in
the graph (:func:`~gradreg.sharding.check_penalty_graph`) on the first call, and on every call
once there were any; on the first call, that the norms have a double backward
(:func:`~gradreg.autograd.check_double_backward`) and, with ``subsample`` or ``chunks``, that the
samples do not interact (:func:`~gradreg.penalties.coupling.check_independent_samples`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gradreg import sharding
from gradreg.autograd import check_double_backward
from gradreg.penalties.checks import check_per_sample, check_per_sample_losses
from gradreg.penalties.coupling import check_independent_samples
from gradreg.penalties.loss_scale import LossScale
from gradreg.penalties.norms import NormPenalty
from gradreg.penalties.projections import PROJECTIONS

if TYPE_CHECKING:
    from collections.abc import MutableMapping

    from gradreg.penalties.config import PenaltyConfig

__all__ = ["ExactPenalty", "RunningMean"]


class RunningMean:
    r"""StyleGAN2's running mean of the norms, :math:`a \leftarrow a + \text{decay}\,
    (\mathrm{mean}_i\, n_i - a)` from :math:`a = 0`, kept in a buffer of the module it belongs to
    (``<name>.ema`` in that module's checkpoints).

    ``buffers``: the module's registered buffers, where the mean is ``buffers[name]``; it is
    looked up on every use, since ``module.to(...)``, ``module.double()`` and
    ``load_state_dict(..., assign=True)`` put another tensor in its place. ``decay``: the
    option ``ema_decay``.

    The mean is kept on the norms' device (a penalty module left on the CPU while the model
    trains on a GPU moves its buffer there at the first update) and updated in at least float32
    and in the norms' dtype where that is wider: a float64 run promotes the buffer to float64
    (its ``.data``, in place, so optimizers, DDP and checkpoints keep the same tensor), a bf16
    run does not lose the small updates to bf16 rounding, and a buffer cast to bf16 or float16
    (``module.to(torch.bfloat16)``, Lightning's ``precision="bf16-true"``) is widened back to
    float32 before its next update.

    Examples:
        >>> import torch
        >>> from gradreg.penalties.exact import RunningMean
        >>> buffers = {"ema": torch.zeros(())}
        >>> mean = RunningMean(buffers, "ema", decay=0.5)
        >>> mean.update(torch.tensor([2.0, 4.0]))  # 0 + 0.5 * (3 - 0)
        tensor(1.5000)
        >>> mean.update(torch.tensor([3.0, float("nan")])), buffers["ema"]  # a NaN batch: kept
        (tensor(1.5000), tensor(1.5000))
    """

    def __init__(self, buffers: MutableMapping[str, Tensor], name: str, decay: float) -> None:
        self.buffers, self.name, self.decay = buffers, name, decay

    @property
    def value(self) -> Tensor:
        """The buffer that holds the mean."""
        return self.buffers[self.name]

    def update(self, norms: Tensor) -> Tensor:
        """The mean updated by ``norms`` (written to the buffer, detached), with the current
        batch's term keeping its gradient exactly as in the reference code.

        A batch whose mean norm is NaN or Inf leaves the running mean as it was
        (``torch.where``, no host sync): its penalty is not finite (refused by
        ``check_finite``), and the next finite batch goes on from the last finite mean.
        """
        self.promote(norms.dtype, norms.device)
        ema = self.value
        mean = norms.mean().to(ema.dtype)
        updated = torch.where(torch.isfinite(mean), ema.lerp(mean, self.decay), ema)
        ema.copy_(updated.detach())
        return updated

    @contextmanager
    def kept_wide(self) -> Iterator[None]:
        """Around a cast of the module (``Module._apply``: ``.to``, ``.half()``,
        ``.bfloat16()``): a mean cast to a dtype narrower than float32 is put back as the mean
        before the cast, on the new device, in at least float32 (not rounded to the new
        dtype)."""
        before = self.value
        yield
        after = self.value
        if after is not before and after.is_floating_point() and after.element_size() < 4:
            self.buffers[self.name] = before.detach().to(
                device=after.device, dtype=torch.promote_types(before.dtype, torch.float32))

    def promote(self, dtype: torch.dtype, device: torch.device | None = None) -> None:
        """Widen the buffer to ``dtype``, and to at least float32, where that is wider (in
        place), and move it to ``device`` (None: where it is; a new tensor in the buffer's place,
        as ``module.to(device)`` puts there)."""
        ema = self.value
        wider = torch.promote_types(torch.promote_types(dtype, ema.dtype), torch.float32)
        if device is not None and device != ema.device:
            self.buffers[self.name] = ema.detach().to(device=device, dtype=wider)
        elif wider != ema.dtype:
            ema.data = ema.data.to(wider)


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
        >>> from gradreg.penalties.exact import ExactPenalty, RunningMean
        >>> from gradreg.penalties.norms import NormPenalty
        >>> config = PenaltyConfig(points="real")
        >>> exact = ExactPenalty(config, NormPenalty(target=0.0, squared=True),
        ...                      RunningMean({"ema": torch.zeros(())}, "ema", decay=0.01))
        >>> x = torch.randn(4, 2, requires_grad=True)
        >>> exact(x @ torch.tensor([3.0, 4.0]), (x,), None)
        tensor(25.)
    """

    def __init__(self, config: PenaltyConfig, of_norms: NormPenalty,
                 running_mean: RunningMean) -> None:
        self.config, self.of_norms, self.running_mean = config, of_norms, running_mean
        self._checked = False  # the first call's checks passed
        self._through_sharded = False  # FSDP2 modules in the graph: checked on every call

    def __call__(self, outputs: Tensor, inputs: tuple[Tensor, ...],
                 loss_scale: LossScale) -> Tensor:
        config = self.config
        if config.per_sample:
            check_per_sample(outputs, inputs)
            if config.of == "loss":
                check_per_sample_losses(outputs)
        if not self._checked or self._through_sharded:
            self._through_sharded = sharding.check_penalty_graph(outputs)
        norms = PROJECTIONS[config.projection](outputs, inputs, config, loss_scale)
        if not self._checked:
            check_double_backward(norms, outputs)
            if config.subsample < 1 or config.chunks > 1:
                check_independent_samples(
                    outputs, inputs, f"subsample={config.subsample}, chunks={config.chunks}")
            self._checked = True
        target = self.running_mean.update(norms) if config.target == "ema" else config.target
        return self.of_norms(norms, target)
