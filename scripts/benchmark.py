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

``hand`` is the straight hand-written double backward (written out, not imported) with the
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

    python scripts/benchmark.py            # full grid (minutes on 2 CPU cores)
    python scripts/benchmark.py --quick    # seconds: tiny grid, one thread
    python scripts/benchmark.py --suite gpu --device cuda [--autocast bf16]
    python scripts/benchmark.py --transformer --threads 1 [--suite gpu --device cuda]
    python scripts/benchmark.py --param-gradient --threads 1 --clock cpu   # GNP, SAM vs by hand
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import benchmarking.quiet_profiler  # noqa: F401 (before torch: sets its log levels)
import torch
from benchmarking.cases import grid, make_case
from benchmarking.report import machine, markdown, plot, table
from benchmarking.steps import METHODS, applicable
from benchmarking.timing import measure

from gradreg.models import ACTIVATIONS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


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
    parser.add_argument("--sharded", action="store_true",
                        help="memory per rank of an FSDP2-sharded critic, 2 gloo ranks "
                             "(benchmarking/sharded.py)")
    parser.add_argument("--transformer", action="store_true",
                        help="penalties through attention: a ViT critic with R1 and a "
                             "transformer classifier with param_grad_norm "
                             "(benchmarking/transformer.py)")
    parser.add_argument("--param-gradient", action="store_true",
                        help="GNP and SAM against their hand-written two-pass recipes "
                             "(benchmarking/param_gradient.py)")
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmark"))
    args = parser.parse_args(argv)
    if args.sharded:
        from benchmarking.sharded import main as sharded

        return sharded(args.out, args.quick)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    threads = args.threads or (1 if args.quick else None)
    if threads:
        torch.set_num_threads(threads)
    if args.transformer:
        from benchmarking.transformer import main as transformer
        from benchmarking.transformer import table as transformer_table

        rows = transformer(args.quick, args.suite, device, args.reps,
                           time.perf_counter if args.clock == "wall" else time.process_time)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "transformer.json").write_text(json.dumps(
            {"machine": machine(device), "suite": args.suite, "clock": args.clock, "rows": rows},
            indent=1))
        (args.out / "transformer.md").write_text(transformer_table(rows) + "\n")
        return rows
    if args.param_gradient:
        from benchmarking import param_gradient

        rows = param_gradient.main(args.quick, args.reps, time.perf_counter
                                   if args.clock == "wall" else time.process_time)
        errors = param_gradient.errors(args.quick)
        print(param_gradient.error_table(errors))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "param_gradient.json").write_text(json.dumps(
            {"machine": machine(device), "clock": args.clock, "rows": rows, "errors": errors},
            indent=1))
        (args.out / "param_gradient.md").write_text(
            param_gradient.table(rows) + "\n\n" + param_gradient.error_table(errors) + "\n")
        return rows
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    autocast = None if args.autocast is None else DTYPES[args.autocast]
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    reps = args.reps or (3 if args.quick else 25)
    rows: list[dict] = []
    kinds = None if args.cases is None else set(args.cases.split(","))
    for kind, batch, width in grid(args.quick, args.suite):
        if kinds is not None and kind not in kinds:
            continue
        build = (kind, batch, width, args.activation, dtype, device)
        case = make_case(*build)
        twin = make_case(*build, gradreg_batchnorm=True) if case.has_batchnorm else None
        rows += measure(case, applicable(case, METHODS), reps, device, clock, autocast, twin)
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
