"""Lazy regularization: the optimizer settings for a penalty taken as its own step every
``every`` minibatches (StyleGAN2). The penalty's own lazy counter is
:meth:`GradientPenalty.due <gradreg.penalties.GradientPenalty.due>`."""

from __future__ import annotations

__all__ = ["lazy_optimizer_kwargs"]

def lazy_optimizer_kwargs(
    lr: float, betas: tuple[float, float] = (0.9, 0.999), every: int = 1
) -> dict[str, float | tuple[float, float]]:
    r"""StyleGAN2's optimizer correction for a penalty taken as its own step every ``every``.

    Over ``every`` minibatches the optimizer then takes ``every + 1`` steps; with
    :math:`c = k/(k+1)` the corrected settings are ``lr * c`` and ``betas ** c``, which keeps the
    learning rate per minibatch and the moment decay per minibatch as without the extra steps.
    Not needed when the penalty is added to the task loss on the due step (one step either way).

    Examples:
        StyleGAN2's discriminator, R1 every 16 minibatches (c = 16/17):

        >>> from gradreg.penalties import lazy_optimizer_kwargs
        >>> kwargs = lazy_optimizer_kwargs(0.0025, (0.0, 0.99), every=16)
        >>> round(kwargs["lr"], 8), round(kwargs["betas"][1], 8)
        (0.00235294, 0.99058546)
    """
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an int >= 1, got {every!r}.")
    ratio = every / (every + 1)
    return {"lr": lr * ratio, "betas": (betas[0] ** ratio, betas[1] ** ratio)}
