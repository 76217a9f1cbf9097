"""No leaks: nothing of step k (graph, gradient, points) is alive at step k+1.

``create_graph=True`` makes gradients that carry their own graph; kept alive by a reference cycle
(pytorch#4661: ``backward(create_graph=True)`` links ``param.grad`` and its graph) or by state on
the penalty, every step would leak a graph. Measured on the tiny model: one retained step costs
~23 KB, so 2,000 leaked steps would be ~45 MB; the bound below is 2 MB (< 100 steps' worth).
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Iterator

import pytest
from penalty_cases import batch, penalty, sgd_step, task_loss, tiny_model

from gradreg.penalties import interpolate

STEPS, WARMUP, MAX_GROWTH_BYTES = 2000, 200, 2_000_000


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def gc_disabled() -> Iterator[None]:
    """With the cycle collector off, any cycle that holds a graph would leak and show in RSS."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("name", ["wgan_gp", "path_length", "intermediate"])
def test_resident_memory_is_flat_over_2000_steps(name: str, gc_disabled: None) -> None:
    model, gp = tiny_model(), penalty(name)
    for step in range(WARMUP):  # allocator pools, lazy inits, the first-call checks
        sgd_step(gp, model, batch(step))
    gc.collect()  # garbage of the first calls (lazy imports, checks) is not what is measured
    before = resident_bytes()
    for step in range(STEPS):
        sgd_step(gp, model, batch(step))
    growth = resident_bytes() - before
    assert growth < MAX_GROWTH_BYTES, f"{growth / 1e6:.1f} MB over {STEPS} steps"
    assert gc.collect() == 0, "the steps created reference cycles"


def test_step_objects_are_freed_by_reference_counting(gc_disabled: None) -> None:
    """Points, outputs and penalty of a WGAN-GP step die when the step's names go out of scope,
    without the cycle collector; the penalty keeps only a detached ``last_value``."""
    model, gp = tiny_model(), penalty("wgan_gp")
    x = batch(0)
    points = interpolate(x, x.flip(0))
    outputs = model(points)
    value = gp(outputs, points)
    (task_loss(model, x) + value).backward()
    refs = [weakref.ref(t) for t in (points, outputs, value)]
    del points, outputs, value
    assert [ref() for ref in refs] == [None, None, None]
    assert gp.last_value.grad_fn is None and not gp.last_value.requires_grad
    assert all(p.grad.grad_fn is None for p in model.parameters() if p.grad is not None)
