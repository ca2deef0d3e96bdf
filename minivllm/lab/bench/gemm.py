"""``python -m minivllm.lab.bench.gemm``: the float32 products of a decode step, ours against
PyTorch's, on the CPU and ISA the kernels were built for.

For each product shape of the default model (SmolLM2-135M: hidden 576, MLP 1536,
9 + 2 x 3 heads of 64, vocabulary 49152) and each row count (the sequences of a
decode step), three ways to compute ``x W^T``, timed in turn in one process
(round after round, so a machine shared with other work slows all three alike):

- ``F.linear``: what the reference layers call (MKL, packing W on every call);
- MKL's packed GEMM (``torch.ops.mkl._mkl_linear`` over a weight packed once);
- ours (``csrc/gemm.cpp``): ``matvec`` for one row, the panel GEMM for more.

Each product runs alone, its weight warm in the caches after the first call; in a
decode step every weight streams from memory instead, which is where the panel
kernel's prefetching pays. So these ratios explain a kernel, and end-to-end A/B
runs (``bench throughput``) decide a route.

It prints each one's median time per call and the ratios; the header names the
CPU and the ISA the kernels were built for. On an AVX-512 machine,
``env $(python -m minivllm.cpu.features --env avx2) python -m minivllm.lab.bench.gemm``
measures the AVX2 build against MKL's and PyTorch's AVX2 paths.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# (name, in_features, out_features) of SmolLM2-135M's products.
SHAPES = [("qkv_proj", 576, 960), ("o_proj", 576, 576), ("gate_up_proj", 576, 3072),
          ("down_proj", 1536, 576), ("lm_head", 576, 49152)]
ROWS = (1, 32, 128)


def seconds_per_call(fn: Callable[[], object], budget: float) -> float:
    """Calls ``fn`` for about ``budget`` seconds (at least 3 times); seconds per call."""
    fn()  # warm: caches, first-touch of the output
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if calls >= 3 and elapsed >= budget:
            return elapsed / calls


def measure(in_features: int, out_features: int, rows: int, rounds: int,
            budget: float) -> dict[str, float]:
    """Median seconds per call of the three products, alternated round by round."""
    from minivllm.cpu import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    packed_mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, max(rows, 1))
    panels = ops.pack_linear_weight(w)
    ways: dict[str, Callable[[], object]] = {
        "F.linear": lambda: F.linear(x, w),
        "mkl_packed": lambda: torch.ops.mkl._mkl_linear(x, packed_mkl, w, None, rows),
        "ours": (lambda: ops.matvec(x, w)) if rows == 1 else
                (lambda: ops.packed_linear(x, panels, out_features)),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, fn in ways.items():
                times[name].append(seconds_per_call(fn, budget))
    return {name: statistics.median(t) for name, t in times.items()}


def run(args: argparse.Namespace) -> list[dict]:
    from minivllm.cpu import _custom_ops as ops
    from minivllm.cpu.features import cpu_features

    problem = ops.build_problem()
    if problem is not None or not ops.packed_linear_available():
        raise SystemExit(f"the panel GEMM is not available here: "
                         f"{problem or 'this build has neither AVX-512 nor AVX2 + FMA'}")
    print(f"# {cpu_features().describe()}; library {ops.library_name()}, panels of "
          f"{ops.panel_width()} columns; {torch.get_num_threads()} threads; "
          f"medians of {args.rounds} alternated rounds")
    print(f"{'product':<13} {'K->N':>11} {'rows':>4} {'F.linear':>10} {'mkl packed':>10} "
          f"{'ours':>10} {'F.lin/ours':>10} {'mkl/ours':>9}")
    results = []
    for name, k, n in SHAPES:
        if args.only and name not in args.only:
            continue
        for rows in args.rows:
            t = measure(k, n, rows, args.rounds, args.budget)
            results.append({"product": name, "in": k, "out": n, "rows": rows, **t})
            print(f"{name:<13} {f'{k}->{n}':>11} {rows:>4} {t['F.linear'] * 1e6:>8.0f}us "
                  f"{t['mkl_packed'] * 1e6:>8.0f}us {t['ours'] * 1e6:>8.0f}us "
                  f"{t['F.linear'] / t['ours']:>9.2f}x {t['mkl_packed'] / t['ours']:>8.2f}x",
                  flush=True)
    return results


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS),
                        help="row counts (sequences of a decode step); default %(default)s")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternated rounds per shape (the median is printed)")
    parser.add_argument("--budget", type=float, default=0.2,
                        help="seconds of calls per product per round")
    parser.add_argument("--only", nargs="*", choices=[s[0] for s in SHAPES],
                        help="only these products")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
