"""``python -m minivllm.lab.bench.gguf_rows``: what a few rows of x cost against one, on the
default file's own blocks (``gguf_linear``).

Speculative decoding pays only if checking k drafts costs little more than
decoding one token: with n-gram drafts, k = 4, a request's verify step is 5 rows of
x against every matrix, a plain decode step one. On a bandwidth-bound machine 5
rows can cost about what 1 costs, if the product reads (and dequantizes) each
weight once for all the rows. This times, per row count (``--rows``, default 1 to
5), every matrix of the file once with that many rows, in alternated rounds in one
process (a machine shared with other work slows all of them alike), and prints the
median and the best time, each with its ratio to one row's (the best: the call least
disturbed by other work):

- ``streamed``: all the file's weights, as a decode step reads them (the same
  bytes, none in the caches when read). Matrices of one block type and width are
  stacked into one, so each is one call of ``gguf_linear`` and per-call costs do not
  water the ratio down (the decode-step replay runs them in one parallel region);
- ``hot``: one matrix per block type small enough to stay in the caches, over and
  over: the kernel's arithmetic alone. The two together say whether rows cost
  memory traffic or compute on this machine.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable, Optional

import torch


def stacked_matrices(path=None) -> list[tuple[int, torch.Tensor, int]]:
    """The file's matrices stacked per (GGML type id, columns): (type id, blocks, columns)."""
    from minivllm.lab.bench.gguf_gemv import file_matrices

    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    for type_id, blocks, cols in file_matrices(path):
        groups.setdefault((type_id, cols), []).append(blocks)
    return [(t, torch.cat(b), c) for (t, c), b in sorted(groups.items())]


def run(args: argparse.Namespace) -> dict:
    from minivllm.cpu import _custom_ops as ops
    from minivllm.cpu.features import cpu_features
    from minivllm.lab.bench.gemm import seconds_per_call
    from minivllm.lab.bench.gguf_gemv import hot_matrix

    if args.threads:
        torch.set_num_threads(args.threads)
    problem = ops.build_problem()
    if problem is not None or not ops.packed_linear_available():
        raise SystemExit(f"the CPU kernels are not available here: {problem or 'no AVX2'}")
    matrices = stacked_matrices(args.model)
    gen = torch.Generator().manual_seed(0)
    xs = {(m, c): torch.randn(m, c, generator=gen)
          for m in args.rows for c in {c for _, _, c in matrices}}
    hot = {t: hot_matrix(matrices, t) for t in sorted({t for t, _, _ in matrices})}

    def streamed(m: int) -> Callable[[], object]:
        return lambda: [ops.gguf_linear(xs[m, c], b, t, None) for t, b, c in matrices]

    def hot_call(m: int, t: int) -> Callable[[], object]:
        blocks, cols = hot[t]
        return lambda: ops.gguf_linear(xs[m, cols], blocks, t, None)

    ways = {("streamed", m): streamed(m) for m in args.rows}
    ways.update({(f"hot type {t}", m): hot_call(m, t) for t in hot for m in args.rows})
    times: dict[tuple[str, int], list[float]] = {k: [] for k in ways}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for key, fn in ways.items():
                times[key].append(seconds_per_call(fn, args.budget))
    step_mb = sum(b.numel() for _, b, _ in matrices) / 1e6
    print(f"# {cpu_features().describe()}; {torch.get_num_threads()} threads; "
          f"{args.rounds} alternated rounds; streamed: {step_mb:.1f} MB of blocks in "
          f"{len(matrices)} stacked matrices (type, columns: "
          f"{', '.join(f'{t}x{c}' for t, _, c in matrices)})")
    print(f"{'':<14} {'rows':>5} {'median ms':>10} {'/ 1 row':>8} {'best ms':>9} {'/ 1 row':>8}")
    out: dict[str, dict[int, dict[str, float]]] = {}
    one = args.rows[0]
    for (name, m), t in times.items():
        med, best = statistics.median(t), min(t)
        ratio = med / statistics.median(times[name, one])
        best_ratio = best / min(times[name, one])
        out.setdefault(name, {})[m] = {"median_s": med, "best_s": best, "ratio": ratio,
                                       "best_ratio": best_ratio}
        print(f"{name:<14} {m:>5} {med * 1e3:>10.3f} {ratio:>7.2f}x {best * 1e3:>9.3f} "
              f"{best_ratio:>7.2f}x")
    return out


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5],
                        help="row counts (the first is the baseline of the ratios)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's; 1 is steadier on a busy machine)")
    parser.add_argument("--budget", type=float, default=0.3,
                        help="seconds of calls per measurement")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
