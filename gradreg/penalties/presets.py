"""Named configurations of :class:`GradientPenalty`: the published penalties, nothing more.

Each preset is a dict of :class:`GradientPenalty` options (:data:`PRESETS`) and a function of the
same name that builds it, taking the weight as its only positional argument:
``wgan_gp(0.1)`` is ``wgan_gp(weight=0.1)`` is ``make_penalty("wgan_gp", weight=0.1)``; every
other option is a keyword (``r1(1.0, every=16)``). Each function's docstring is its formula, its
reference and an example; the options each preset sets, and why, are in the penalties guide
(``docs/penalties.md``, "The presets in detail").
"""

from __future__ import annotations

from typing import Any

from gradreg.penalties.config import PenaltyConfig, check_renamed
from gradreg.penalties.mechanism import GradientPenalty

__all__ = ["PRESETS", "approx_r1", "approx_r2", "asam", "derivative", "double_backprop",
           "dragan", "gr", "hessian", "intermediate", "jacobian", "make_penalty", "max_gp",
           "param_grad_norm", "path_length", "r1", "r2", "sam", "spectral", "wgan_gp", "wgan_lp"]

PRESETS: dict[str, dict[str, Any]] = {
    "wgan_gp": {"weight": 10.0, "target": 1.0, "points": "interpolates"},
    "wgan_lp": {"weight": 10.0, "target": 1.0, "one_sided": True, "points": "interpolates"},
    "r1": {"weight": 10.0, "gain": 0.5, "points": "real"},
    "r2": {"weight": 10.0, "gain": 0.5, "points": "fake"},
    "dragan": {"weight": 10.0, "target": 1.0, "points": "perturbed"},
    "double_backprop": {"weight": 0.1, "points": "inputs", "of": "loss"},
    "intermediate": {"weight": 0.01, "points": "activations", "of": "loss"},
    "jacobian": {"weight": 0.01, "points": "inputs", "projection": "orthonormal"},
    "param_grad_norm": {"weight": 0.01, "power": 1.0, "points": "parameters", "of": "loss"},
    "sam": {"weight": 0.05, "radius": 0.05, "power": 1.0, "points": "parameters", "of": "loss",
            "method": "finite_difference"},
    "asam": {"weight": 0.5, "scale": 0.5, "power": 1.0, "points": "parameters", "of": "loss",
             "method": "finite_difference", "shift": "gradient", "adaptive": True},
    "gr": {"weight": 1e-3, "power": 2.0, "gain": 0.5, "points": "parameters", "of": "loss",
           "method": "finite_difference", "shift": "gradient"},
    "path_length": {"weight": 2.0, "target": "ema", "ema_decay": 0.01, "projection": "gaussian",
                    "points": "latents"},
    "derivative": {"weight": 0.01, "order": 2, "points": "inputs"},
    "approx_r1": {"weight": 10.0, "gain": 0.5, "points": "real", "method": "perturbation"},
    "approx_r2": {"weight": 10.0, "gain": 0.5, "points": "fake", "method": "perturbation"},
    "max_gp": {"weight": 1.0, "points": "interpolates", "reduction": "max"},
    "spectral": {"weight": 0.01, "points": "inputs", "kind": "spectral", "iterations": 10},
    "hessian": {"weight": 0.1, "points": "latents", "kind": "hessian", "reduction": "max",
                "method": "finite_difference"},
}

_OPTIONS = ("weight", *PenaltyConfig.options())
#: The presets of one :math:`\rho`, both their weight and the size of their shift (SAM's radius,
#: ASAM's scale): a weight given alone sets that option too.
RHO = {"sam": "radius", "asam": "scale"}


def make_penalty(name: str, **overrides: Any) -> GradientPenalty:
    r"""The preset ``name`` with ``overrides`` applied, e.g. ``make_penalty("r1", weight=1.0)``.

    Examples:
        R1, :math:`\frac{\gamma}{2} \mathrm{mean}_i \lVert \nabla D(x_i) \rVert^2`, of a linear
        critic :math:`D(x) = w \cdot x` with :math:`\lVert w \rVert^2 = 25`:

        >>> import torch
        >>> from gradreg.penalties import as_points, make_penalty
        >>> w = torch.tensor([3.0, 4.0])
        >>> x = as_points(torch.randn(5, 2))
        >>> make_penalty("r1", weight=1.0)(x @ w, x)  # 1/2 * 25
        tensor(12.5000)
    """
    if name not in PRESETS:
        raise ValueError(f"unknown penalty preset {name!r}; known presets: {', '.join(PRESETS)}.")
    unknown = sorted(set(overrides) - set(_OPTIONS))
    if unknown:
        check_renamed(overrides)
        raise ValueError(
            f"unknown option(s) {unknown} for penalty {name!r}; valid: {', '.join(_OPTIONS)}."
        )
    if name == "gr" and overrides.get("method", "finite_difference") != "finite_difference":
        weight = overrides.get("weight", PRESETS["gr"].get("weight", 1e-3))
        raise ValueError(
            f"gr is GR by finite difference; method={overrides['method']!r} is another penalty: "
            f"its exact form is param_grad_norm({weight}, power=2, gain=0.5) (double backward).")
    shift = RHO.get(name)
    if shift is not None and "weight" in overrides and not {shift, "step"} & set(overrides):
        overrides = {**overrides, shift: overrides["weight"]}  # one rho
    return GradientPenalty(**{**PRESETS[name], **overrides})


def wgan_gp(weight: float = 10.0, **options: Any) -> GradientPenalty:
    r"""WGAN-GP (Gulrajani et al. 2017): :math:`\lambda\, \mathrm{mean}_i (\lVert \nabla D(\hat
    x_i) \rVert - 1)^2` at interpolates :math:`\hat x` (:func:`~gradreg.penalties.interpolate`).

    Args:
        weight: :math:`\lambda`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        A linear critic :math:`D(x) = w \cdot x` with :math:`\lVert w \rVert = 5`:

        >>> import torch
        >>> from gradreg.penalties import as_points, wgan_gp
        >>> w = torch.tensor([3.0, 4.0])
        >>> x = as_points(torch.randn(4, 2))
        >>> wgan_gp()(x @ w, x)  # 10 * (5 - 1)^2
        tensor(160.)
    """
    return make_penalty("wgan_gp", weight=weight, **options)


def wgan_lp(weight: float = 10.0, **options: Any) -> GradientPenalty:
    r"""WGAN-LP (Petzka et al. 2018): :math:`\lambda\, \mathrm{mean}_i \max(0, \lVert \nabla
    D(\hat x_i) \rVert - 1)^2` at interpolates :math:`\hat x`: only norms above 1 are penalized.

    Args:
        weight: :math:`\lambda`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        Linear critics with :math:`\lVert w \rVert = 5` and :math:`\lVert w \rVert = 0.5`:

        >>> import torch
        >>> from gradreg.penalties import as_points, wgan_lp
        >>> w = torch.tensor([3.0, 4.0])
        >>> x = as_points(torch.randn(4, 2))
        >>> wgan_lp()(x @ w, x), wgan_lp()(x @ (w / 10), x)  # 10 * (5 - 1)^2, and 0
        (tensor(160.), tensor(0.))
    """
    return make_penalty("wgan_lp", weight=weight, **options)


def r1(weight: float = 10.0, **options: Any) -> GradientPenalty:
    r"""R1 (Mescheder et al. 2018): :math:`\frac{\gamma}{2}\, \mathrm{mean}_i \lVert \nabla
    D(x_i) \rVert^2` at the real samples.

    Args:
        weight: :math:`\gamma`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        A linear critic with :math:`\lVert w \rVert^2 = 25`:

        >>> import torch
        >>> from gradreg.penalties import as_points, r1
        >>> w = torch.tensor([3.0, 4.0])
        >>> real = as_points(torch.randn(4, 2))
        >>> r1()(real @ w, real)  # 10 / 2 * 25
        tensor(125.)
    """
    return make_penalty("r1", weight=weight, **options)


def r2(weight: float = 10.0, **options: Any) -> GradientPenalty:
    r"""R2 (Mescheder et al. 2018): :math:`\frac{\gamma}{2}\, \mathrm{mean}_i \lVert \nabla
    D(\tilde x_i) \rVert^2` at the fake samples :math:`\tilde x`.

    Args:
        weight: :math:`\gamma`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        A linear critic with :math:`\lVert w \rVert^2 = 25`:

        >>> import torch
        >>> from gradreg.penalties import as_points, r2
        >>> w = torch.tensor([3.0, 4.0])
        >>> fake = as_points(torch.randn(4, 2))
        >>> r2(1.0)(fake @ w, fake)  # 1 / 2 * 25
        tensor(12.5000)
    """
    return make_penalty("r2", weight=weight, **options)


def dragan(weight: float = 10.0, **options: Any) -> GradientPenalty:
    r"""DRAGAN (Kodali et al. 2017): :math:`\lambda\, \mathrm{mean}_i (\lVert \nabla D(\tilde
    x_i) \rVert - 1)^2` at perturbed reals :math:`\tilde x`
    (:func:`~gradreg.penalties.perturb_dragan`).

    Args:
        weight: :math:`\lambda`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        A linear critic with :math:`\lVert w \rVert = 5`:

        >>> import torch
        >>> from gradreg.penalties import dragan, perturb_dragan
        >>> w = torch.tensor([3.0, 4.0])
        >>> x = perturb_dragan(torch.randn(4, 2))
        >>> dragan()(x @ w, x)  # 10 * (5 - 1)^2
        tensor(160.)
    """
    return make_penalty("dragan", weight=weight, **options)


def double_backprop(weight: float = 0.1, **options: Any) -> GradientPenalty:
    r"""Double backpropagation (Drucker & LeCun 1992): :math:`\lambda\, \mathrm{mean}_i \lVert
    \nabla_x \ell_i \rVert^2` of the per-sample task losses :math:`\ell_i` at the inputs.

    Args:
        weight: :math:`\lambda`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        The squared error :math:`\ell_i = (w \cdot x_i - 1)^2 / 2` has
        :math:`\nabla_x \ell_i = (w \cdot x_i - 1)\, w`, of norms 10 and 15 at the two inputs:

        >>> import torch
        >>> from gradreg.penalties import as_points, double_backprop
        >>> w = torch.tensor([3.0, 4.0])
        >>> x = as_points(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        >>> losses = (x @ w - 1).square() / 2
        >>> round(double_backprop()(losses, x).item(), 4)  # 0.1 * (100 + 225) / 2
        16.25
    """
    return make_penalty("double_backprop", weight=weight, **options)


def intermediate(weight: float = 0.01, **options: Any) -> GradientPenalty:
    r"""The input-gradient penalty at hidden layers: :math:`\lambda\, \mathrm{mean}_i \lVert
    \nabla_h \ell_i \rVert^2` of the per-sample losses at the activations :math:`h` of the
    submodules named by ``layers=[...]`` (needed; recorded by :func:`gradreg.capture`).

    Args:
        weight: :math:`\lambda`.
        **options: any other option of :class:`GradientPenalty`, by keyword, ``layers`` among
            them.

    Examples:
        A loss linear in the first layer's activations, :math:`\ell_i = (3, 4) \cdot h_i`:

        >>> import torch
        >>> import gradreg
        >>> from gradreg.penalties import intermediate
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1, bias=False),
        ...                           torch.nn.Flatten(0))
        >>> _ = net[1].weight.data.copy_(torch.tensor([[3.0, 4.0]]))
        >>> with gradreg.capture(net, "0") as activations:
        ...     losses = net(torch.randn(5, 2))
        >>> penalty = intermediate(layers=["0"])
        >>> round(penalty(losses, list(activations.values())).item(), 4)  # 0.01 * (3^2 + 4^2)
        0.25
    """
    return make_penalty("intermediate", weight=weight, **options)


def jacobian(weight: float = 0.01, **options: Any) -> GradientPenalty:
    r"""The Jacobian's squared Frobenius norm (Hoffman, Roberts & Yaida 2019): :math:`\lambda\,
    \mathrm{mean}_i \lVert J_i \rVert_F^2`, :math:`J_i = \partial f(x_i) / \partial x_i`,
    estimated by ``count`` random orthonormal projections per sample.

    Args:
        weight: :math:`\lambda`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        A linear map :math:`f(x) = x A` with :math:`\lVert A \rVert_F^2 = 1 + 4 + 9 + 16`, exact
        with two projections of its two outputs:

        >>> import torch
        >>> from gradreg.penalties import as_points, jacobian
        >>> A = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> x = as_points(torch.randn(3, 2))
        >>> round(jacobian(count=2)(x @ A, x).item(), 4)  # 0.01 * 30
        0.3
    """
    return make_penalty("jacobian", weight=weight, **options)


def param_grad_norm(weight: float = 0.01, **options: Any) -> GradientPenalty:
    r"""The parameter-gradient norm (Zhao, Zhang & Hu 2022): :math:`\lambda\, \lVert \nabla_\theta
    L \rVert` of the task loss :math:`L` over all parameters together (one norm, no samples).

    Args:
        weight: :math:`\lambda`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        :math:`L = \lVert \theta \rVert^2 / 2` has :math:`\nabla_\theta L = \theta`, of norm 5:

        >>> import torch
        >>> from gradreg.penalties import param_grad_norm
        >>> theta = torch.tensor([3.0, 4.0], requires_grad=True)
        >>> round(param_grad_norm()(theta.square().sum() / 2, [theta]).item(), 4)  # 0.01 * 5
        0.05
    """
    return make_penalty("param_grad_norm", weight=weight, **options)


def sam(rho: float = 0.05, **options: Any) -> GradientPenalty:
    r"""Sharpness-aware minimization (Foret et al. 2021) as a penalty: :math:`\rho\, \lVert
    \nabla_\theta L \rVert` by finite difference with radius :math:`\rho`, so that ``loss +
    sam(rho)(LossAt(fn, loss), params)`` has SAM's gradient :math:`\nabla L(\theta + \rho\,g /
    \lVert g \rVert)`, :math:`g = \nabla L(\theta)`.

    Args:
        rho: the neighbourhood radius :math:`\rho`, the weight and the radius.
        **options: any other option of :class:`GradientPenalty` but the weight and the radius,
            by keyword.

    Examples:
        :math:`L = \lVert \theta \rVert^2 / 2` has :math:`\nabla L(\theta + \rho\hat\theta)
        = \theta (1 + \rho/\lVert\theta\rVert)` = (3, 4) x 1.01 at :math:`\rho = 0.05`:

        >>> import torch
        >>> from gradreg.penalties import sam
        >>> from gradreg.penalties.methods.param_gradient import LossAt
        >>> theta = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
        >>> at = LossAt.run(lambda: theta.square().sum() / 2)
        >>> (at.loss + sam(0.05)(at, [theta])).backward()
        >>> theta.grad
        tensor([3.0300, 4.0400], dtype=torch.float64)
    """
    return _of_rho("sam", rho, options)


def asam(rho: float = 0.5, **options: Any) -> GradientPenalty:
    r"""Adaptive SAM (Kwon et al. 2021) as a penalty: :math:`\rho\,\lVert \lvert\theta\rvert
    \odot g \rVert`, :math:`g = \nabla L(\theta)`, so that ``loss + asam(rho)(LossAt(fn, loss),
    params)`` has ASAM's gradient :math:`\nabla L(\theta + \rho\, T^2 g / \lVert T g \rVert)`,
    :math:`T = \lvert\theta\rvert`.

    Args:
        rho: the neighbourhood radius :math:`\rho`, the weight and the scale.
        **options: any other option of :class:`GradientPenalty` but the weight and the scale,
            by keyword.

    Examples:
        :math:`L = \lVert \theta \rVert^2 / 2`: :math:`g = \theta`, :math:`\epsilon = \rho
        \theta^3/\lVert\theta^2\rVert` = (27, 64) x 0.5/√337 and the gradient is
        :math:`\theta + \epsilon`:

        >>> import torch
        >>> from gradreg.penalties import asam
        >>> from gradreg.penalties.methods.param_gradient import LossAt
        >>> theta = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
        >>> at = LossAt.run(lambda: theta.square().sum() / 2)
        >>> (at.loss + asam(0.5)(at, [theta])).backward()
        >>> theta.grad
        tensor([3.7354, 5.7432], dtype=torch.float64)
    """
    return _of_rho("asam", rho, options)


def _of_rho(name: str, rho: float, options: dict[str, Any]) -> GradientPenalty:
    """The preset ``name`` whose weight and shift size (:data:`RHO`) are both ``rho``; either
    given apart is refused."""
    apart = sorted({"weight", "step", RHO[name]} & set(options))
    if apart:
        raise ValueError(
            f"{name}(rho) sets both its weight and its {RHO[name]} to rho; {apart} apart would "
            f"make it another penalty: pass {name}(rho), or param_grad_norm(weight, "
            f"method='finite_difference', {RHO[name]}=...) for a weight of its own.")
    return make_penalty(name, weight=rho, **options)


def gr(weight: float = 1e-3, **options: Any) -> GradientPenalty:
    r"""Gradient regularization as in gradientregularization_trl (Ackermann et al. 2026):
    :math:`\tfrac{\lambda}{2} \lVert \nabla_\theta L \rVert^2` by finite difference over the
    shift :math:`\epsilon g` (``scale``), :math:`g = \nabla L(\theta)`, so that ``loss +
    gr(lam)(LossAt(fn, loss), params)`` has the gradient :math:`g + (\lambda/\epsilon)(\nabla
    L(\theta + \epsilon g) - g)`.

    Args:
        weight: :math:`\lambda` (their ``grad_reg_strength``).
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        :math:`L = \lVert \theta \rVert^2 / 2` has :math:`H = I`, so the gradient is
        :math:`(1 + \lambda)\,\theta` = (3, 4) x 1.1 at :math:`\lambda = 0.1`:

        >>> import torch
        >>> from gradreg.penalties import gr
        >>> from gradreg.penalties.methods.param_gradient import LossAt
        >>> theta = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
        >>> at = LossAt.run(lambda: theta.square().sum() / 2)
        >>> (at.loss + gr(0.1)(at, [theta])).backward()
        >>> theta.grad
        tensor([3.3000, 4.4000], dtype=torch.float64)
    """
    return make_penalty("gr", weight=weight, **options)


def path_length(weight: float = 2.0, **options: Any) -> GradientPenalty:
    r"""StyleGAN2's path-length regularization (Karras et al. 2020): :math:`w\, \mathrm{mean}_i
    (\lVert J_i^\top y_i \rVert - a)^2` of the generator's Jacobian :math:`J_i` at the latents,
    :math:`y_i \sim N(0, I)/\sqrt{\text{pixels}}`, :math:`a` the running mean of the norms.

    Args:
        weight: :math:`w`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        :math:`G(w) = 3w` on 10000 features: every :math:`\lVert J_i^\top y_i \rVert = 3
        \lVert y_i \rVert \approx 3`, so the first call's running mean is about
        :math:`0.01 \cdot 3`:

        >>> import torch
        >>> from gradreg.penalties import as_points, path_length
        >>> _ = torch.manual_seed(0)
        >>> latents = as_points(torch.randn(4, 10000))
        >>> penalty = path_length()
        >>> value = penalty(3 * latents, latents)  # about 2 * (3 - 0.03)^2 = 17.64
        >>> round(penalty.ema.item(), 2), round(value.item())
        (0.03, 18)
    """
    return make_penalty("path_length", weight=weight, **options)


def derivative(weight: float = 0.01, **options: Any) -> GradientPenalty:
    r"""A higher derivative's norm: :math:`\lambda\, \mathrm{mean}_i \lVert \partial^n (\sum f) /
    \partial x_i^n \rVert^2` at the inputs, :math:`n` = ``order``.

    Args:
        weight: :math:`\lambda`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        :math:`f(x) = (w \cdot x)^2 / 2` has gradient :math:`(w \cdot x)\, w`, whose entries
        sum to :math:`7\, w \cdot x` for :math:`w = (3, 4)`; its gradient is :math:`7 w`, of
        squared norm :math:`49 \cdot 25`:

        >>> import torch
        >>> from gradreg.penalties import as_points, derivative
        >>> w = torch.tensor([3.0, 4.0])
        >>> x = as_points(torch.randn(3, 2))
        >>> round(derivative()((x @ w).square() / 2, x).item(), 4)  # 0.01 * 1225
        12.25
    """
    return make_penalty("derivative", weight=weight, **options)


def approx_r1(weight: float = 10.0, **options: Any) -> GradientPenalty:
    r"""R1 without a double backward (Lin et al. 2025, rescaled to R1's :math:`\gamma`):
    :math:`\frac{\gamma}{2}\, \mathrm{mean}_i \lVert D(x_i + \sigma\epsilon_i) - D(x_i)
    \rVert^2 / \sigma^2` at the reals, :math:`\epsilon_i \sim N(0, I)`. Call it with the critic
    itself, ``penalty(D, x)``.

    Args:
        weight: :math:`\gamma`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        A linear critic with :math:`\lVert w \rVert^2 = 25`: R1 is 125; with 1000 probes the
        estimate is within a few percent of it:

        >>> import torch
        >>> from gradreg.penalties import approx_r1, as_points
        >>> _ = torch.manual_seed(0)
        >>> w = torch.tensor([3.0, 4.0])
        >>> real = as_points(torch.randn(8, 2))
        >>> round(approx_r1(count=1000)(lambda x: x @ w, real).item(), 1)
        126.7
    """
    return make_penalty("approx_r1", weight=weight, **options)


def approx_r2(weight: float = 10.0, **options: Any) -> GradientPenalty:
    r"""R2 without a double backward: :math:`\frac{\gamma}{2}\, \mathrm{mean}_i \lVert
    D(\tilde x_i + \sigma\epsilon_i) - D(\tilde x_i) \rVert^2 / \sigma^2` at the fakes
    :math:`\tilde x`, :math:`\epsilon_i \sim N(0, I)`. Call it as ``penalty(D, fake)``.

    Args:
        weight: :math:`\gamma`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        A linear critic with :math:`\lVert w \rVert^2 = 25`: R2 is 125; with 1000 probes the
        estimate is within a few percent of it:

        >>> import torch
        >>> from gradreg.penalties import approx_r2, as_points
        >>> _ = torch.manual_seed(0)
        >>> w = torch.tensor([3.0, 4.0])
        >>> fake = as_points(torch.randn(8, 2))
        >>> round(approx_r2(count=1000)(lambda x: x @ w, fake).item(), 1)
        126.7
    """
    return make_penalty("approx_r2", weight=weight, **options)


def max_gp(weight: float = 1.0, **options: Any) -> GradientPenalty:
    r"""Max-GP (StudioGAN): :math:`\lambda\, \max_i \lVert \nabla D(\hat x_i) \rVert^2` at
    interpolates :math:`\hat x`: the largest per-sample value of the batch.

    Args:
        weight: :math:`\lambda`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        :math:`D(x) = (w \cdot x)^2 / 2` has gradient norms :math:`5\,|w \cdot x|`, here 3 and 2:

        >>> import torch
        >>> from gradreg.penalties import as_points, max_gp
        >>> w = torch.tensor([3.0, 4.0])
        >>> x = as_points(torch.tensor([[0.2, 0.0], [0.0, 0.1]]))  # w.x = 0.6, 0.4
        >>> round(max_gp()((x @ w).square() / 2, x).item(), 4)  # max(3^2, 2^2)
        9.0
    """
    return make_penalty("max_gp", weight=weight, **options)


def spectral(weight: float = 0.01, **options: Any) -> GradientPenalty:
    r"""The Jacobian's spectral norm: :math:`\lambda\, \mathrm{mean}_i
    \sigma_{\max}(\partial f(x_i) / \partial x_i)^2` by power iteration
    (:mod:`~gradreg.penalties.kinds.spectral`). Call it with the model itself, ``penalty(f, x)``.

    Args:
        weight: :math:`\lambda`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        :math:`f(x) = x\, \mathrm{diag}(3, 1)` has :math:`\sigma_{\max} = 3` at every input:

        >>> import torch
        >>> from gradreg.penalties import as_points, spectral
        >>> A = torch.diag(torch.tensor([3.0, 1.0]))
        >>> x = as_points(torch.randn(4, 2))
        >>> round(spectral()(lambda x: x @ A, x).item(), 4)  # 0.01 * 3^2
        0.09
    """
    return make_penalty("spectral", weight=weight, **options)


def hessian(weight: float = 0.1, **options: Any) -> GradientPenalty:
    r"""The Hessian penalty (Peebles et al. 2020): :math:`\lambda` times the maximum over samples
    and output units :math:`j` of :math:`\operatorname{Var}_v(v^\top H_j v)`, :math:`v`
    Rademacher, by the authors' central difference (:mod:`~gradreg.penalties.kinds.hessian`).
    Call it with the generator itself, ``penalty(G, z)``.

    Args:
        weight: :math:`\lambda`.
        **options: any other option of :class:`GradientPenalty`, by keyword.

    Examples:
        :math:`G(z) = z_1 z_2` has :math:`v^\top H v = 2 v_1 v_2 = \pm 2`: two directions of
        opposite signs have variance 8, the largest over the samples; :math:`z_1^2 + z_2^2`
        (a diagonal Hessian) has none:

        >>> import torch
        >>> from gradreg.penalties import as_points, hessian
        >>> _ = torch.manual_seed(0)
        >>> z = as_points(torch.randn(8, 2))
        >>> round(hessian()(lambda z: z[:, 0] * z[:, 1], z).item(), 4)  # 0.1 * 8
        0.8
        >>> round(hessian()(lambda z: z.square().sum(1), z).item(), 4)
        0.0
    """
    return make_penalty("hessian", weight=weight, **options)
