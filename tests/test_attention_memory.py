"""The blockwise double backward through attention keeps no query x key tensor: its peak
resident memory, in a process of its own, stays below one L x L tensor of attention
probabilities (measured: 25 MB against 64 MB; the MATH backend's: 765 MB)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

#: One head of L x L float32 probabilities at this length: 64 MB.
LENGTH = 4096

SCRIPT = textwrap.dedent(f"""
    import contextlib, json, sys
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from gradreg.attention import scaled_dot_product_attention

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, {LENGTH}, 16, generator=g).requires_grad_() for _ in range(3))
    math = sys.argv[1] == "math"
    attention = F.scaled_dot_product_attention if math else scaled_dot_product_attention
    def status(field):  # bytes
        with open("/proc/self/status") as f:
            return 1024 * int(next(x for x in f if x.startswith(field + ":")).split()[1])

    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak afresh (ru_maxrss starts at the
        f.write("5")                                # parent's resident memory at the fork)
    with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
        out = attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
        sum(g.square().sum() for g in grads).backward()
    peak = status("VmHWM")
    print(json.dumps({{"growth": peak - before, "grad": float(q.grad.square().sum())}}))
""")


def run(method: str) -> dict:
    result = subprocess.run([sys.executable, "-c", SCRIPT, method], check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout)


@pytest.mark.slow
def test_the_double_backward_keeps_no_sequence_by_sequence_tensor() -> None:
    one_probability_matrix = LENGTH * LENGTH * 4
    ours, math = run("ours"), run("math")
    assert ours["growth"] < one_probability_matrix, ours
    assert math["growth"] > 2 * one_probability_matrix, math  # the oracle measures what it should
    assert ours["grad"] == pytest.approx(math["grad"], rel=1e-4)
