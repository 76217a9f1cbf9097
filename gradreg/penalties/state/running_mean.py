r"""StyleGAN2's running mean of the per-sample norms, the target of ``target="ema"`` (path
length), kept in a buffer of the penalty module."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["RunningMean"]


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
        >>> from gradreg.penalties.state.running_mean import RunningMean
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
        (``torch.where``, no host sync, on the condition :math:`m - m = 0`, true exactly for a
        finite :math:`m`: two kernels, where ``torch.isfinite`` is four): its penalty is not
        finite (refused by ``check_finite``), and the next finite batch goes on from the last
        finite mean.
        """
        self.promote(norms.dtype, norms.device)
        ema = self.value
        mean = norms.mean().to(ema.dtype)
        updated = torch.where(mean - mean == 0, ema.lerp(mean, self.decay), ema)
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
                device=after.device, dtype=_widest(before.dtype, torch.float32))

    def promote(self, dtype: torch.dtype, device: torch.device | None = None) -> None:
        """Widen the buffer to ``dtype``, and to at least float32, where that is wider (in
        place), and move it to ``device`` (None: where it is; a new tensor in the buffer's place,
        as ``module.to(device)`` puts there)."""
        ema = self.value
        wider = _widest(dtype, ema.dtype, torch.float32)
        if device is not None and device != ema.device:
            self.buffers[self.name] = ema.detach().to(device=device, dtype=wider)
        elif wider != ema.dtype:
            ema.data = ema.data.to(wider)


def _widest(*dtypes: torch.dtype) -> torch.dtype:
    """The widest of floating-point ``dtypes`` (the first of the widest; bf16 and float16 are
    both narrower than the float32 always among them), read off their sizes without a call into
    torch's dispatcher (``torch.promote_types`` is one, on every update)."""
    return max(dtypes, key=lambda dtype: dtype.itemsize)
