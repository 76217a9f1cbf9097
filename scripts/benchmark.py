"""Cost of a gradient-penalty training step, per computation method, against the plain step.

For each case (model x penalty x batch size x width) and each method, in one process, with the
steps interleaved round-robin so that machine noise hits all alike, this measures:

* the median time of a full training step (zero_grad, forward, backward, SGD step) and its
  ratio to the plain step (no penalty) of the same case; wall time, or process CPU time with
  ``--clock cpu`` (robust on a shared machine when run with ``--threads 1``);
* the peak memory growth of one forward + backward (gradients zeroed before): on CUDA
  ``max_memory_allocated`` minus the allocation at the start; on CPU the peak of the running sum
  of the allocator's events recorded by ``torch.profiler`` (bytes of tensors allocated minus
  freed since the step began: tensor memory only, no allocator caching, no Python objects), and
  its ratio to the plain step's;
* the floating-point operations of one step (``torch.utils.flop_counter``: matrix products and
  convolutions, forward and every backward, double backward included) and their ratio to the
  plain step's: the cost floor that no implementation of the same method goes below, free of
  timing noise;
* for the approximate methods, the relative error ``|G - G_exact| / |G_exact|`` of the penalty's
  parameter gradient on the same points (``subsample`` against the full-batch penalty).

``hand`` is the straight hand-written double backward (written here, not imported) with the
usual ``loss.backward()``; the gradreg methods use :func:`gradreg.regularized_backward`, which
computes parameter gradients only, so ``exact / hand`` is the toolkit's overhead net of that
saving. ``lazy16`` is ``every=16`` amortized: each sample is the mean over 16 consecutive steps,
and its ratio is to the plain step timed the same way (blocks of 16 steps: a block's mean carries
noise that a median of single steps drops). ``chunks`` is ``chunks=4`` (its own forward at the
points, like ``subsample``). ``exact_bn`` and ``plain_bn`` are ``exact`` and ``plain`` on a twin of
the model whose BatchNorm layers are gradreg's (:func:`gradreg.convert_batchnorm`: closed-form
double backward), same seed and data, its own optimizer, interleaved with the others; only for
cases with BatchNorm.

``--suite gpu`` runs the GPU cases: ResNet-18 on CIFAR-sized inputs (torchvision's,
with the 3x3 stem and no max pooling; batch 128) and a small BatchNorm ResNet, double backprop on
the per-sample cross-entropy; the DCGAN critic at 64x64 (batch 64) with WGAN-GP (own forward at
the interpolates) and R1 (StyleGAN2's shared forward: the gradient of the adversarial term's real
scores); the MLP 784-1024-1024-10 at batch 1024 with double backprop. ``--autocast bf16`` runs
forward and backward under ``torch.autocast``; on CUDA every timed region ends with a
synchronize (none on CPU). The JSON names the GPU and the torch version.
Writes ``benchmark.json``, ``benchmark.md`` (the table) and ``benchmark.png`` (log-log cost
against batch size and against parameter count) into ``--out``.

    python scripts/benchmark.py            # full grid (minutes on 2 CPU cores; compiles)
    python scripts/benchmark.py --quick    # seconds: tiny grid, one thread, no compile
    python scripts/benchmark.py --suite gpu --device cuda [--autocast bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from gradreg import convert_batchnorm, regularized_backward
from gradreg.penalties import GradientPenalty, as_points, interpolate, make_penalty

METHODS = ("plain", "plain_bn", "hand", "exact", "exact_bn", "lazy16", "subsample", "chunks",
           "finite_difference", "compiled")
ACTIVATIONS = {"tanh": nn.Tanh, "softplus": nn.Softplus, "relu": nn.ReLU}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: Methods run on the twin with gradreg's BatchNorm, and the method each one runs there.
TWIN_METHODS = {"plain_bn": "plain", "exact_bn": "exact"}


#: Inputs of the MLP cases: MNIST-sized, and the 8x8 digits of the app (the targets' reference).
MLP_INPUTS = {"mlp": 784, "digits_mlp": 64}


def mlp(n_in: int, width: int, n_out: int, act: type[nn.Module]) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(n_in, width), act(), nn.Linear(width, width),
                         act(), nn.Linear(width, n_out))


def cnn(width: int, act: type[nn.Module]) -> nn.Module:
    """A classifier of 1x8x8 images: two 3x3 convolutions, average pooling, a linear head."""
    return nn.Sequential(nn.Conv2d(1, width, 3, padding=1), act(),
                         nn.Conv2d(width, width, 3, padding=1), act(), nn.AvgPool2d(2),
                         nn.Flatten(), nn.Linear(width * 16, 10))


def bn_cnn(width: int, act: type[nn.Module]) -> nn.Module:
    """A small ResNet of 3-channel images: a 3x3 stem, one basic block (conv-BN-act-conv-BN plus
    the identity), global average pooling, a linear head; BatchNorm after every convolution."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False),
                                      nn.BatchNorm2d(width), act(),
                                      nn.Conv2d(width, width, 3, padding=1, bias=False),
                                      nn.BatchNorm2d(width))
            self.act = act()

        def forward(self, x: Tensor) -> Tensor:
            return self.act(x + self.body(x))

    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                         act(), Block(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width, 10))


def resnet18_cifar() -> nn.Module:
    """torchvision's ResNet-18 with the CIFAR stem (3x3 stride-1 first convolution, no max
    pooling), as in the GPU measurements in docs/benchmarks.md."""
    try:
        import torchvision
    except ImportError as err:
        raise SystemExit("error: case 'resnet18' needs torchvision (install the build that "
                         "matches your torch), or leave it out with --cases") from err
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model


def dcgan_critic(width: int) -> nn.Module:
    """The DCGAN discriminator of 3x64x64 images (widths W..8W, LeakyReLU 0.2), one score."""
    layers: list[nn.Module] = []
    for c_in, c_out in ((3, width), (width, 2 * width), (2 * width, 4 * width),
                        (4 * width, 8 * width)):
        layers += [nn.Conv2d(c_in, c_out, 4, 2, 1), nn.LeakyReLU(0.2)]
    return nn.Sequential(*layers, nn.Conv2d(8 * width, 1, 4, 1, 0), nn.Flatten(0))


def conv_critic(width: int, act: type[nn.Module], size: int) -> nn.Module:
    """A 3-layer DCGAN-style critic of 3 x size x size images (stride-2 convolutions)."""
    return nn.Sequential(nn.Conv2d(3, width, 4, 2, 1), act(), nn.Conv2d(width, 2 * width, 4, 2, 1),
                         act(), nn.Conv2d(2 * width, 4 * width, 4, 2, 1), act(), nn.Flatten(),
                         nn.Linear(4 * width * (size // 8) ** 2, 1), nn.Flatten(0))


class PerSampleLoss(nn.Module):
    """Per-sample cross-entropy of a classifier: a module, as 'compiled' needs; the labels are
    the penalty's ``fn_args`` (split with the points by ``subsample`` and ``chunks``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self.model(x), labels, reduction="none")


#: Image classifiers with double backprop: (model builder, input shape); width is the builder's.
IMAGE_CLASSIFIERS: dict[str, tuple[Callable[[int, type[nn.Module]], nn.Module],
                                   Callable[[int], tuple[int, ...]]]] = {
    "cnn": (cnn, lambda width: (1, 8, 8)),
    "bn_cnn": (bn_cnn, lambda width: (3, 32, 32) if width >= 16 else (3, 8, 8)),
    "resnet18": (lambda width, act: resnet18_cifar(), lambda width: (3, 32, 32)),
}


@dataclass
class Case:
    """One benchmark configuration: the forward passes every method's step is built from."""

    name: str
    model: nn.Module
    penalty: str  # a gradreg preset
    batch: int
    width: int
    task: Callable[[], Tensor]  # the plain step's loss
    points: Callable[[], Tensor]  # fresh evaluation points (leaves requiring grad)
    fn: nn.Module  # per-sample outputs at given points: fn(points, *fn_args)
    fn_args: tuple[Tensor, ...]  # the per-sample labels of a classifier's loss
    shared: bool  # whether the task loss's forward is at the points (R1, double backprop)
    task_with: Callable[[Tensor], tuple[Tensor, Tensor]]  # (task loss, outputs at the points)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def make_case(kind: str, batch: int, width: int, act: type[nn.Module], dtype: torch.dtype,
              device: torch.device, gradreg_batchnorm: bool = False) -> Case:
    """The case ``kind``; with ``gradreg_batchnorm`` its model's BatchNorm layers are gradreg's
    (:func:`gradreg.convert_batchnorm`), everything else identical (same seed)."""
    torch.manual_seed(0)
    convert = convert_batchnorm if gradreg_batchnorm else (lambda module: module)
    if kind in MLP_INPUTS or kind in IMAGE_CLASSIFIERS:
        if kind in MLP_INPUTS:
            shape, model = (MLP_INPUTS[kind],), mlp(MLP_INPUTS[kind], width, 10, act)
        else:
            build, shape_of = IMAGE_CLASSIFIERS[kind]
            shape, model = shape_of(width), build(width, act)
        model = convert(model).to(device, dtype)
        x = torch.randn(batch, *shape, device=device, dtype=dtype)
        y = torch.randint(0, 10, (batch,), device=device)
        fn = PerSampleLoss(model)

        def task_with(p: Tensor) -> tuple[Tensor, Tensor]:
            losses = fn(p, y)
            return losses.mean(), losses

        return Case(f"{kind}/double_backprop", model, "double_backprop", batch, width,
                    lambda: fn(x, y).mean(), lambda: as_points(x), fn, (y,), True, task_with)
    if kind.startswith("dcgan"):
        family, size, critic = "dcgan", 64, dcgan_critic(width)
    else:  # the quick grid's tiny critics see 8x8 images
        size = 32 if width >= 16 else 8
        family, critic = "critic", conv_critic(width, act, size)
    critic = convert(critic).to(device, dtype)
    real = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    fake = torch.randn(batch, 3, size, size, device=device, dtype=dtype)

    def logistic(d_real: Tensor) -> Tensor:  # the non-saturating critic loss
        return F.softplus(critic(fake)).mean() + F.softplus(-d_real).mean()

    if kind.endswith("_r1"):
        def task_with(p: Tensor) -> tuple[Tensor, Tensor]:
            d_real = critic(p)
            return logistic(d_real), d_real

        return Case(f"{family}/r1", critic, "r1", batch, width, lambda: logistic(critic(real)),
                    lambda: as_points(real), critic, (), True, task_with)

    def wasserstein() -> Tensor:
        return critic(fake).mean() - critic(real).mean()

    def task_and_scores(p: Tensor) -> tuple[Tensor, Tensor]:
        return wasserstein(), critic(p)

    return Case(f"{family}/wgan_gp", critic, "wgan_gp", batch, width, wasserstein,
                lambda: interpolate(real, fake), critic, (), False, task_and_scores)


def hand_written(penalty: str, g: Tensor) -> Tensor:
    """The usual reference code: ``lambda * mean(||g|| - 1)^2`` or ``gamma/2 * mean ||g||^2``."""
    sq = g.flatten(1).square().sum(1)
    if penalty == "wgan_gp":
        return 10.0 * (g.flatten(1).norm(2, dim=1) - 1).square().mean()
    if penalty == "r1":
        return 5.0 * sq.mean()
    return sq.mean()


def steps(case: Case) -> tuple[dict[str, Callable[[], Tensor]], dict[str, GradientPenalty]]:
    """The loss of one training step for each method (the caller runs backward and the update),
    and the penalties they use."""
    pens = {"exact": make_penalty(case.penalty), "lazy16": make_penalty(case.penalty, every=16),
            "subsample": make_penalty(case.penalty, subsample=0.25),
            "chunks": make_penalty(case.penalty, chunks=4),
            "finite_difference": make_penalty(case.penalty, method="finite_difference"),
            "compiled": make_penalty(case.penalty, method="compiled")}

    def hand() -> Tensor:
        p = case.points()
        loss, out = case.task_with(p)
        (g,) = torch.autograd.grad(out.sum(), p, create_graph=True)
        return loss + hand_written(case.penalty, g)

    def exact(pen: GradientPenalty) -> Tensor:
        p = case.points()
        loss, out = case.task_with(p)
        return loss + pen(out, p)

    def lazy() -> Tensor:
        return exact(pens["lazy16"]) if pens["lazy16"].due() else case.task()

    def own_forward(pen: GradientPenalty) -> Tensor:
        return case.task() + pen(case.fn, case.points(), fn_args=case.fn_args)

    def finite_difference() -> Tensor:
        if not case.shared:
            return own_forward(pens["finite_difference"])
        p = case.points()
        loss, out = case.task_with(p)
        # the forward at the points themselves is the task's: fn returns it instead of recomputing
        return loss + pens["finite_difference"](
            lambda q, *args: out if q is p else case.fn(q, *args), p, fn_args=case.fn_args)

    table = {"plain": case.task, "hand": hand, "exact": lambda: exact(pens["exact"]),
             "lazy16": lazy, "subsample": lambda: own_forward(pens["subsample"]),
             "chunks": lambda: own_forward(pens["chunks"]),
             "finite_difference": finite_difference,
             "compiled": lambda: own_forward(pens["compiled"])}
    return table, pens


def penalty_gradient(case: Case, penalty: GradientPenalty, points: Tensor,
                     outputs: Tensor | nn.Module) -> Tensor:
    params = [p for p in case.model.parameters() if p.requires_grad]
    value = penalty(outputs, points, fn_args=() if isinstance(outputs, Tensor) else case.fn_args)
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                      for p, g in zip(params, grads, strict=True)])


def exact_gradient(case: Case, points: Tensor) -> Tensor:
    return penalty_gradient(case, make_penalty(case.penalty), points,
                            case.fn(points, *case.fn_args))


def relative_errors(case: Case, pens: dict[str, GradientPenalty],
                    methods: list[str]) -> dict[str, float]:
    """|G - G_exact| / |G_exact| of the penalty's parameter gradient on the same points."""
    points = case.points()
    exact = exact_gradient(case, points)
    return {m: float((penalty_gradient(case, pens[m], points, case.fn) - exact).norm()
                     / exact.norm())
            for m in methods if m in ("subsample", "chunks", "finite_difference", "compiled")}


def twin_error(case: Case, twin: Case) -> float:
    """The same relative error of the twin with gradreg's BatchNorm (parameters still equal)."""
    points = case.points()
    exact = exact_gradient(case, points)
    return float((exact_gradient(twin, points) - exact).norm() / exact.norm())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(run: Callable[[], None], device: torch.device) -> int:
    """Peak bytes of tensors allocated during ``run`` above those alive when it starts."""
    if device.type == "cuda":
        synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


def measure(case: Case, methods: tuple[str, ...], reps: int, device: torch.device,
            clock: Callable[[], float], autocast: torch.dtype | None = None,
            twin: Case | None = None) -> list[dict]:
    """The rows of ``case``; the :data:`TWIN_METHODS` run on ``twin`` (the same case with
    gradreg's BatchNorm), with its own parameters and optimizer, interleaved with the others.
    ``autocast``: the dtype of ``torch.autocast`` around forward and backward."""
    losses, pens = steps(case)

    def optimized(model: nn.Module) -> tuple[list[Tensor], torch.optim.Optimizer]:
        params = list(model.parameters())
        return params, torch.optim.SGD(params, lr=1e-6)

    params, optimizer = optimized(case.model)
    runs = {m: (losses[m], params, optimizer) for m in methods if m not in TWIN_METHODS}
    if twin is not None:
        twin_losses, twin_params = steps(twin)[0], optimized(twin.model)
        runs |= {m: (twin_losses[base], *twin_params)
                 for m, base in TWIN_METHODS.items() if m in methods}
    methods = tuple(m for m in methods if m in runs)
    errors: dict[str, str] = {}
    bn_error = {"exact_bn": twin_error(case, twin)} if "exact_bn" in methods else {}

    def forward_backward(method: str) -> None:
        loss, params, _ = runs[method]
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            if method in ("plain", "plain_bn", "hand"):  # the usual hand-written loop
                loss().backward()
            else:  # gradreg's: parameter gradients only
                regularized_backward(loss(), [], params)

    def step(method: str) -> None:
        optimizer = runs[method][2]
        optimizer.zero_grad(set_to_none=True)
        forward_backward(method)
        optimizer.step()

    def timed(method: str, calls: int = 1) -> float:
        synchronize(device)
        start = clock()
        for _ in range(calls):
            step(method)
        synchronize(device)
        return (clock() - start) / calls

    active = []
    for method in methods:  # warm up (compiles), and drop methods that refuse this case
        try:
            for _ in range(2):
                step(method)
            active.append(method)
        except (ValueError, RuntimeError) as err:
            errors[method] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    times: dict[str, list[float]] = {m: [] for m in active}
    plain_blocks: list[float] = []  # the reference of lazy16's blocks
    for _ in range(reps):
        for method in active:
            times[method].append(timed(method, 16 if method == "lazy16" else 1))
        plain_blocks.append(timed("plain", 16))
    rel = relative_errors(case, pens, active) | bn_error
    memory = {}
    for method in active:
        if method != "lazy16":
            runs[method][2].zero_grad(set_to_none=True)
            memory[method] = peak_memory(lambda m=method: forward_backward(m), device)
    flops = {m: count_flops(lambda m=m: step(m), 16 if m == "lazy16" else 1)
             for m in active if m != "compiled"}  # compiled code is opaque to the counter
    plain_ms, plain_mem = statistics.median(times["plain"]) * 1e3, memory["plain"]
    rows = []
    for method in methods:
        row = {"case": case.name, "penalty": case.penalty, "batch": case.batch,
               "width": case.width, "parameters": case.parameters, "method": method}
        if method in errors:
            rows.append({**row, "refused": errors[method]})
            continue
        ms = statistics.median(times[method]) * 1e3
        reference = statistics.median(plain_blocks) * 1e3 if method == "lazy16" else plain_ms
        row.update(median_ms=ms, ratio=ms / reference, peak_bytes=memory.get(method),
                   error=rel.get(method), flops=flops.get(method),
                   flop_ratio=flops[method] / flops["plain"] if method in flops else None)
        row["memory_ratio"] = None if method == "lazy16" else memory[method] / plain_mem
        row["peak_mb"] = None if method == "lazy16" else memory[method] / 2**20
        rows.append(row)
    return rows


class FlopCount(TorchDispatchMode):
    """Sums torch's flop formulas (``flop_registry``: mm, addmm, convolution and their backward
    ops) over every op dispatched while active. ``FlopCounterMode`` itself cannot be used: its
    module tracker's backward hooks refuse ``autograd.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def count_flops(run: Callable[[], None], calls: int) -> float:
    """Floating-point operations per call of ``run``, mean over ``calls`` calls."""
    with FlopCount() as counter:
        for _ in range(calls):
            run()
    return counter.total / calls


def grid(quick: bool, suite: str = "cpu") -> list[tuple[str, int, int]]:
    """(kind, batch, width) of each case. The ``gpu`` suite is the GPU cases: ResNet-18
    (CIFAR, batch 128), the small BatchNorm ResNet, the DCGAN critic at 64x64 (batch 64,
    WGAN-GP and R1) and the MLP 784-1024-1024-10 at batch 1024; ``quick`` shrinks either."""
    if suite == "gpu":
        if quick:
            return [("bn_cnn", 8, 4), ("dcgan_wgan_gp", 4, 4), ("dcgan_r1", 4, 4), ("mlp", 32, 32)]
        return [("resnet18", 128, 64), ("bn_cnn", 128, 64), ("dcgan_wgan_gp", 64, 64),
                ("dcgan_r1", 64, 64), ("mlp", 1024, 1024)]
    if quick:
        return [("mlp", 32, 32), ("mlp", 128, 32), ("cnn", 8, 4), ("critic_wgan_gp", 4, 4),
                ("critic_r1", 4, 4)]
    return [("mlp", 64, 256), ("mlp", 256, 256), ("mlp", 1024, 256), ("mlp", 4096, 256),
            ("mlp", 256, 64), ("mlp", 256, 1024), ("digits_mlp", 256, 256),
            ("cnn", 32, 16), ("cnn", 128, 16), ("cnn", 128, 32), ("bn_cnn", 64, 16),
            ("critic_wgan_gp", 16, 32), ("critic_wgan_gp", 64, 32),
            ("critic_r1", 16, 32), ("critic_r1", 64, 32)]


def machine(device: torch.device) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"cpu": cpu, "gpu": gpu, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "cpus": os.cpu_count()}


#: (heading, row key, format, text width) of each column of the printed and Markdown tables.
COLUMNS = (("case", "case", "", 26), ("batch", "batch", "d", 5), ("width", "width", "d", 5),
           ("params", "parameters", "d", 8), ("method", "method", "", 17),
           ("median ms", "median_ms", ".2f", 9), ("× plain", "ratio", ".2f", 7),
           ("peak MB", "peak_mb", ".1f", 8),
           ("FLOPs × plain", "flop_ratio", ".2f", 13),
           ("peak mem × plain", "memory_ratio", ".2f", 16), ("rel. error", "error", ".1e", 10))


def cells(row: dict) -> list[str]:
    """The row's formatted values, one per column ("–" where a value does not apply); a method
    that refused the case has its error in place of the measurements."""
    if "refused" in row:
        return [format(row[key], spec) for _, key, spec, _ in COLUMNS[:5]] + [
            f"refused: {row['refused']}"] + [""] * (len(COLUMNS) - 6)
    return ["–" if row.get(key) is None else format(row[key], spec)
            for _, key, spec, _ in COLUMNS]


def table(rows: list[dict]) -> str:
    """The rows as aligned text, as printed after each case."""
    def line(values: list[str]) -> str:  # text columns to the left, numbers to the right
        return " ".join(f"{v:{'<' if spec == '' else '>'}{width}}"
                        for v, (_, _, spec, width) in zip(values, COLUMNS, strict=True)).rstrip()

    return "\n".join([line([head for head, *_ in COLUMNS])] + [line(cells(r)) for r in rows])


def markdown(rows: list[dict]) -> str:
    """The rows as the Markdown table of docs/benchmarks.md."""
    lines = ["| " + " | ".join(head for head, *_ in COLUMNS) + " |",
             "|" + "|".join("---" if spec == "" else "---:" for _, _, spec, _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_batch, by_params) = plt.subplots(1, 2, figsize=(11, 4.5))
    timed = [r for r in rows if "median_ms" in r]
    colors = {"plain": "black", "hand": "tab:orange", "exact": "tab:blue",
              "finite_difference": "tab:green"}  # color: method; line style and marker: case
    for (case, style) in zip(sorted({r["case"] for r in timed}), ("-o", "--s", ":^", "-.v"),
                             strict=False):
        widths = [r["width"] for r in timed if r["case"] == case]
        width = max(set(widths), key=widths.count)  # the width most cases ran at
        batches = [r["batch"] for r in timed if r["case"] == case]
        batch = max(set(batches), key=batches.count)
        for method, color in colors.items():
            mine = [r for r in timed if r["case"] == case and r["method"] == method]
            for ax, x, fixed, value in ((by_batch, "batch", "width", width),
                                        (by_params, "parameters", "batch", batch)):
                pts = sorted((r[x], r["median_ms"]) for r in mine if r[fixed] == value)
                if len(pts) > 1:
                    ax.plot(*zip(*pts, strict=True), style, color=color,
                            label=f"{case} {method}")
    for ax, xlabel in ((by_batch, "batch size"), (by_params, "parameters")):
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="step time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny grid, 3 repetitions, seconds")
    parser.add_argument("--suite", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: the GPU-sized cases (ResNet-18 needs torchvision)")
    parser.add_argument("--autocast", choices=("bf16",), default=None,
                        help="run forward and backward under torch.autocast in this dtype")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="torch.backends.cudnn.benchmark = True (autotuned convolutions)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--activation", choices=sorted(ACTIVATIONS), default="tanh",
                        help="relu makes finite_difference refuse (piecewise linear)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="include method 'compiled' (default: on, off with --quick)")
    parser.add_argument("--reps", type=int, default=None, help="timed steps per method")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's; 1 with --quick)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: process CPU time, robust on a shared machine (use --threads 1)")
    parser.add_argument("--cases", default=None,
                        help="comma-separated case kinds to run (default: all), e.g. "
                             "digits_mlp,critic_wgan_gp; kinds: mlp, digits_mlp, cnn, "
                             "critic_wgan_gp, critic_r1; with --suite gpu: resnet18, bn_cnn, "
                             "dcgan_wgan_gp, dcgan_r1, mlp")
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmark"))
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    threads = args.threads or (1 if args.quick else None)
    if threads:
        torch.set_num_threads(threads)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    autocast = None if args.autocast is None else DTYPES[args.autocast]
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    use_compile = (not args.quick) if args.compile is None else args.compile
    methods = tuple(m for m in METHODS if use_compile or m != "compiled")
    reps = args.reps or (3 if args.quick else 25)
    rows: list[dict] = []
    kinds = None if args.cases is None else set(args.cases.split(","))
    for kind, batch, width in grid(args.quick, args.suite):
        if kinds is not None and kind not in kinds:
            continue
        torch._dynamo.reset()  # each case compiles afresh, below dynamo's recompile limit
        build = (kind, batch, width, ACTIVATIONS[args.activation], dtype, device)
        case = make_case(*build)
        twin = (make_case(*build, gradreg_batchnorm=True)
                if any(isinstance(m, BATCHNORMS) for m in case.model.modules()) else None)
        rows += measure(case, methods, reps, device, clock, autocast, twin)
        print(table([r for r in rows if r["case"] == case.name and r["batch"] == batch
                     and r["width"] == width]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine(device), "device": str(device), "dtype": args.dtype,
            "autocast": args.autocast, "cudnn_benchmark": args.cudnn_benchmark,
            "suite": args.suite, "activation": args.activation, "reps": reps,
            "clock": args.clock, "rows": rows}
    (args.out / "benchmark.json").write_text(json.dumps(info, indent=1))
    (args.out / "benchmark.md").write_text(markdown(rows))
    plot(rows, args.out / "benchmark.png")
    print(f"\n{json.dumps(info['machine'])}\nwrote {args.out / 'benchmark.json'}, .md and "
          f"{args.out / 'benchmark.png'}")
    return rows


if __name__ == "__main__":
    main()
