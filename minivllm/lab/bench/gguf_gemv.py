"""``python -m minivllm.lab.bench.gguf_gemv``: how close the one-row product on GGUF blocks
comes to this machine's memory bandwidth, on the default file's own weights.

A single-stream decode step reads every matrix once, one row of x against each:
its ceiling is the bytes of the blocks over the memory bandwidth (the roofline of
``minivllm bench roofline``). Three rates, measured in alternated rounds in one
process, so that a machine shared with other work slows all of them alike:

- ``probe``: the bandwidth ceiling as ``bench roofline`` measures it, the float32
  one-row product (``csrc/gemm.cpp``'s matvec) over 1 GiB;
- ``streamed``: ``gguf_linear`` with one row over every matrix of the file in turn
  (the bytes a step reads; none of it is in the caches when it is read), each its
  own call and parallel region (the decode-step replay runs them all in one);
- ``hot``: one matrix of each block type small enough to stay in the caches, over
  and over: what the kernel computes when memory costs nothing, i.e. the most it
  can stream. If it is below the probe, the kernel, not memory, bounds a step.
- the same two with ``int8`` after the name: ``gguf_linear_int8``, x quantized to
  int8 blocks (``activation_dtype="int8"``; Q4_0, Q4_1 and Q8_0 matrices, the
  others as ``gguf_linear``). ``hot type 2`` (Q4_0, not in the default file) is
  random blocks of the Q4_1 matrix's shape.

It prints the best and the median over rounds of each round's fastest call (GB/s of
blocks or floats read) and the best ones' ratios to the probe's best.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Optional

import torch

from minivllm.lab.bench.roofline import DEFAULT_BANDWIDTH_BYTES


def _seconds(fn: Callable[[], object], calls: int) -> float:
    """The fastest of ``calls`` calls (after one warm-up): on a shared machine, the one
    least disturbed by others."""
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def file_matrices(path=None) -> list[tuple[int, torch.Tensor, int]]:
    """The file's matrices as (GGML type id, blocks uint8 [rows, row_bytes], columns)."""
    import gguf

    from minivllm.model.layers.quantization import BLOCK_TYPES
    from minivllm.model.resolve import default_gguf_path

    out = []
    for t in gguf.GGUFReader(str(path or default_gguf_path())).tensors:
        if len(t.shape) < 2 or t.tensor_type.name not in BLOCK_TYPES:
            continue
        rows, cols = int(t.shape[-1]), int(t.shape[0])
        blocks = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(rows, -1)
        out.append((BLOCK_TYPES[t.tensor_type.name].type_id, blocks, cols))
    return out


def hot_matrix(matrices, type_id: int, max_bytes: int = 4 << 20):
    """The first rows of the file's matrices of ``type_id`` (those as wide as the first), at most ``max_bytes`` (in the
    last-level cache of most CPUs, and large enough that a call is not its overhead)."""
    cols = next(c for t, _, c in matrices if t == type_id)
    blocks = torch.cat([b for t, b, c in matrices if t == type_id and c == cols])
    rows = max(4, min(blocks.shape[0], max_bytes // blocks.shape[1]) // 4 * 4)
    return blocks[:rows].contiguous(), cols


def run(args: argparse.Namespace) -> dict:
    from minivllm.cpu import _custom_ops as ops
    from minivllm.cpu.features import cpu_features

    problem = ops.build_problem()
    if problem is not None or not ops.packed_linear_available():
        raise SystemExit(f"the CPU kernels are not available here: {problem or 'no AVX2'}")
    matrices = file_matrices(args.model)
    xs = {c: torch.randn(1, c) for _, _, c in matrices}
    step_bytes = sum(b.numel() for _, b, _ in matrices)

    from minivllm.model.layers.quantization import BLOCK_TYPES
    from minivllm.model.layers.quantization.int8_activations import INT8_TYPES

    int8_ids = {BLOCK_TYPES[n].type_id for n in INT8_TYPES}

    def step(int8: bool = False):
        for type_id, blocks, cols in matrices:
            linear = ops.gguf_linear_int8 if int8 and type_id in int8_ids else ops.gguf_linear
            linear(xs[cols], blocks, type_id, None)

    probe_w = torch.ones(args.probe_bytes // 4 // 1024, 1024)
    probe_x = torch.ones(1, 1024)
    ways: dict[str, tuple[Callable[[], object], int, int]] = {
        "probe": (lambda: ops.matvec(probe_x, probe_w), probe_w.numel() * 4, 3),
        "streamed": (step, step_bytes, 5), "streamed int8": (lambda: step(True), step_bytes, 5)}
    hot = {t: hot_matrix(matrices, t) for t in sorted({t for t, _, _ in matrices})}
    q4_1, q4_0 = BLOCK_TYPES["Q4_1"], BLOCK_TYPES["Q4_0"]
    if q4_1.type_id in hot and q4_0.type_id not in hot:
        from minivllm.lab.bench.gguf_gemm import random_blocks

        rows, cols = hot[q4_1.type_id][0].shape[0], hot[q4_1.type_id][1]
        hot[q4_0.type_id] = (torch.from_numpy(random_blocks("Q4_0", rows, cols)), cols)
    for type_id, (blocks, cols) in sorted(hot.items()):
        x = torch.randn(1, cols)
        ways[f"hot type {type_id}"] = (
            lambda b=blocks, x=x, t=type_id: ops.gguf_linear(x, b, t, None), blocks.numel(), 20)
        if type_id in int8_ids:
            ways[f"hot type {type_id} int8"] = (
                lambda b=blocks, x=x, t=type_id: ops.gguf_linear_int8(x, b, t, None),
                blocks.numel(), 20)
    rates: dict[str, list[float]] = {name: [] for name in ways}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (fn, nbytes, calls) in ways.items():
                rates[name].append(nbytes / _seconds(fn, calls) / 1e9)
    probe = max(rates["probe"])
    print(f"# {cpu_features().describe()}; {torch.get_num_threads()} threads; "
          f"{args.rounds} alternated rounds; a step reads {step_bytes / 1e6:.1f} MB of blocks "
          f"(types {sorted({t for t, _, _ in matrices})})")
    print(f"{'':<18} {'best GB/s':>10} {'median':>8} {'best / probe':>13} {'int8 / float':>13}")
    for name, r in rates.items():
        base = rates.get(name[:-len(" int8")]) if name.endswith(" int8") else None
        vs = f"{max(r) / max(base):>12.2f}x" if base else ""
        print(f"{name:<18} {max(r):>10.1f} {statistics.median(r):>8.1f} {max(r) / probe:>12.0%} "
              f"{vs}")
    return {name: {"best": max(r), "median": statistics.median(r)} for name, r in rates.items()}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds")
    parser.add_argument("--probe-bytes", type=int, default=DEFAULT_BANDWIDTH_BYTES,
                        help="bytes of the float32 probe's weight (default 1 GiB)")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
