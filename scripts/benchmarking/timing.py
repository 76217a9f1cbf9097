"""Timing, peak memory and FLOPs of each method's training step, interleaved round-robin.

Every method runs the same step: ``zero_grad``, forward, backward, SGD update. The hand-written
methods (``plain``, ``plain_bn``, ``hand``) use ``loss.backward()``; gradreg's use
:func:`gradreg.regularized_backward`, which computes parameter gradients only.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.flop_counter import flop_registry

from benchmarking.cases import Case
from benchmarking.steps import TWIN_METHODS, penalties, relative_errors, step_losses, twin_error
from gradreg import regularized_backward
from gradreg.penalties import GradientPenalty
from gradreg.torch_compat import TorchDispatchMode

HAND_WRITTEN = ("plain", "plain_bn", "hand")
#: Steps per timed sample of ``lazy16``: one sample is the mean over a whole lazy cycle.
LAZY_BLOCK = 16


@dataclass
class Run:
    """One method's step: its loss, the parameters it updates and their optimizer."""

    loss: Callable[[], Tensor]
    params: list[Tensor]
    optimizer: torch.optim.Optimizer
    hand_written: bool


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """Runs, times and measures the steps of several methods on one device.

    ``clock``: ``time.perf_counter`` or ``time.process_time``; ``autocast``: the dtype of
    ``torch.autocast`` around forward and backward, or None.
    """

    def __init__(self, runs: dict[str, Run], device: torch.device, clock: Callable[[], float],
                 autocast: torch.dtype | None) -> None:
        self.runs, self.device, self.clock, self.autocast = runs, device, clock, autocast

    def forward_backward(self, method: str) -> None:
        run = self.runs[method]
        with torch.autocast(self.device.type, dtype=self.autocast,
                            enabled=self.autocast is not None):
            if run.hand_written:
                run.loss().backward()
            else:
                regularized_backward(run.loss(), [], run.params)

    def step(self, method: str) -> None:
        optimizer = self.runs[method].optimizer
        optimizer.zero_grad(set_to_none=True)
        self.forward_backward(method)
        optimizer.step()

    def timed(self, method: str, calls: int = 1) -> float:
        """Seconds per step, mean over ``calls`` consecutive steps."""
        synchronize(self.device)
        start = self.clock()
        for _ in range(calls):
            self.step(method)
        synchronize(self.device)
        return (self.clock() - start) / calls

    def warm_up(self, methods: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
        """Two steps of each method; the methods that ran, and why the others refused
        this case."""
        active, refused = [], {}
        for method in methods:
            try:
                for _ in range(2):
                    self.step(method)
                active.append(method)
            except (ValueError, RuntimeError) as err:
                refused[method] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        return active, refused

    def time(self, methods: list[str], reps: int) -> tuple[dict[str, list[float]], list[float]]:
        """``reps`` rounds of one timed sample per method (``lazy16``: a block of 16 steps), then
        one block of 16 plain steps: the reference of ``lazy16``."""
        times: dict[str, list[float]] = {m: [] for m in methods}
        plain_blocks = []
        for _ in range(reps):
            for method in methods:
                times[method].append(self.timed(method, LAZY_BLOCK if method == "lazy16" else 1))
            plain_blocks.append(self.timed("plain", LAZY_BLOCK))
        return times, plain_blocks

    def peak_memory(self, method: str) -> int:
        """Peak bytes of tensors allocated by one forward + backward, gradients zeroed before."""
        self.runs[method].optimizer.zero_grad(set_to_none=True)
        return peak_memory(lambda: self.forward_backward(method), self.device)

    def flops(self, method: str) -> float:
        calls = LAZY_BLOCK if method == "lazy16" else 1
        return count_flops(lambda: self.step(method), calls)


def peak_memory(run: Callable[[], None], device: torch.device) -> int:
    """Peak bytes of tensors allocated during ``run`` above those alive when it starts: on CUDA
    from the allocator's statistics, on CPU from the profiler's allocation events."""
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
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def count_flops(run: Callable[[], None], calls: int) -> float:
    """Floating-point operations per call of ``run``, mean over ``calls`` calls."""
    with FlopCount() as counter:
        for _ in range(calls):
            run()
    return counter.total / calls


def method_runs(case: Case, pens: dict[str, GradientPenalty], methods: tuple[str, ...],
                twin: Case | None) -> dict[str, Run]:
    """The runs of ``methods`` on ``case`` with the penalties ``pens`` (one optimizer for all)
    and of the :data:`TWIN_METHODS` on ``twin`` (its own penalties, parameters and optimizer)."""

    def runs_of(target: Case, target_pens: dict[str, GradientPenalty],
                names: dict[str, str]) -> dict[str, Run]:
        losses = step_losses(target, target_pens)
        params = list(target.model.parameters())
        optimizer = torch.optim.SGD(params, lr=1e-6)
        return {m: Run(losses[base], params, optimizer, m in HAND_WRITTEN)
                for m, base in names.items()}

    runs = runs_of(case, pens, {m: m for m in methods if m not in TWIN_METHODS})
    if twin is not None:
        runs |= runs_of(twin, penalties(twin),
                        {m: base for m, base in TWIN_METHODS.items() if m in methods})
    return runs


def measure(case: Case, methods: tuple[str, ...], reps: int, device: torch.device,
            clock: Callable[[], float], autocast: torch.dtype | None = None,
            twin: Case | None = None) -> list[dict]:
    """The rows of ``case``, one per method: median step time and its ratio to the plain step,
    peak memory, FLOPs and the gradient's relative error; ``twin`` is the same case with
    gradreg's BatchNorm, for the :data:`TWIN_METHODS`."""
    pens = penalties(case)
    runs = method_runs(case, pens, methods, twin)
    runner = Runner(runs, device, clock, autocast)
    methods = tuple(m for m in methods if m in runs)
    # before any step: the twin's parameters are the case's only until the first update
    twin_errors = {"exact_bn": twin_error(case, twin)} if "exact_bn" in methods else {}
    active, refused = runner.warm_up(methods)
    times, plain_blocks = runner.time(active, reps)
    errors = relative_errors(case, pens, active) | twin_errors
    memory = {m: runner.peak_memory(m) for m in active if m != "lazy16"}
    flops = {m: runner.flops(m) for m in active}
    plain_ms = statistics.median(times["plain"]) * 1e3
    rows = []
    for method in methods:
        row = {"case": case.name, "penalty": case.penalty, "batch": case.batch,
               "width": case.width, "parameters": case.parameters, "method": method}
        if method in refused:
            rows.append({**row, "refused": refused[method]})
            continue
        ms = statistics.median(times[method]) * 1e3
        reference = statistics.median(plain_blocks) * 1e3 if method == "lazy16" else plain_ms
        row.update(median_ms=ms, ratio=ms / reference, peak_bytes=memory.get(method),
                   error=errors.get(method), flops=flops.get(method),
                   flop_ratio=flops[method] / flops["plain"] if method in flops else None)
        row["memory_ratio"] = None if method == "lazy16" else memory[method] / memory["plain"]
        row["peak_mb"] = None if method == "lazy16" else memory[method] / 2**20
        rows.append(row)
    return rows
