"""``python -m minivllm.lab.bench.gguf_gemm``: a decode batch's products on GGUF blocks
(``csrc/gguf_gemm.cpp``) against the float32 panel GEMM (``csrc/gemm.cpp``) on the
same numbers, per shape of the default model and per row count.

Why it exists: ``quantization="auto"`` keeps a GGUF file's blocks, and where a step
is compute-bound (batches of 8-256 rows) the quantized kernel pays a
dequantization per call that the float path does not; this prints what that costs
per product. The float weight is the blocks
dequantized, so both compute the same product. The two are timed in turn, round
after round, in one process (a machine shared with other work slows both alike);
it prints median microseconds per call and quantized / float speed (> 1: the
blocks are faster). Weights are warm in the caches after the first call, unlike
a decode step, which streams them (there the blocks read 4-6x fewer bytes).

``--layers N``: instead, N distinct copies of one decoder layer's products (q, k,
v, o, gate_up, down) run in turn as one call, as a decode step runs them: with
the default model's 30, 426 MB of float32 panels against 70 MB of blocks, far
more than the caches, so each product's weights come from memory as in a step.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from minivllm.lab.bench.gemm import seconds_per_call

# (name, in_features, out_features, GGML type) of SmolLM2-135M-Instruct.Q4_1.gguf's
# products (its head is the tied Q8_0 embedding).
SHAPES = [("q_proj/o_proj", 576, 576, "Q4_1"), ("k/v_proj", 576, 192, "Q4_1"),
          ("gate_up_proj", 576, 3072, "Q4_1"), ("down_proj", 1536, 576, "Q4_1"),
          ("lm_head", 576, 49152, "Q8_0")]
ROWS = (8, 32, 64, 128, 256)
# One decoder layer's products in the order a step runs them (q, k, v, o, gate_up, down).
LAYER = [SHAPES[0], SHAPES[1], SHAPES[1], SHAPES[0], SHAPES[2], SHAPES[3]]


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, row_bytes] uint8 blocks of ``qtype``: the gguf package's quantizer where
    it has one, else random bytes with small float16 scales (any bytes are a valid
    K-quant block). Shared with tests/test_quantization.py."""
    import gguf

    from minivllm.model.layers.quantization import BLOCK_TYPES

    rng = np.random.default_rng(seed)
    try:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                    gguf.GGMLQuantizationType[qtype])
    except NotImplementedError:
        bt = BLOCK_TYPES[qtype]
        q = rng.integers(0, 256, (rows * cols // bt.block_size, bt.type_size), dtype=np.uint8)
        scales = np.float16(rng.random((q.shape[0], 2)) * 0.01).view(np.uint8)
        if qtype == "Q4_K":
            q[:, 0:4] = scales
        else:  # Q6_K: d is the last 2 bytes
            q[:, -2:] = scales[:, :2]
        return np.ascontiguousarray(q).reshape(rows, -1)


def measure(K: int, N: int, qtype: str, rows: int, rounds: int, budget: float) -> dict:
    """Median seconds per call, float panel GEMM and quantized kernel, alternated."""
    from minivllm.cpu import _custom_ops as ops
    from minivllm.model.layers.quantization import BLOCK_TYPES

    tid = BLOCK_TYPES[qtype].type_id
    blocks = torch.from_numpy(random_blocks(qtype, N, K))
    w = ops.gguf_dequantize(blocks, tid, K)
    panels = ops.pack_linear_weight(w)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(1))
    runs = {"float": lambda: ops.packed_linear(x, panels, N, None),
            "gguf": lambda: ops.gguf_linear(x, blocks, tid, None)}
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            times[k].append(seconds_per_call(fn, budget))
    return {k: statistics.median(v) for k, v in times.items()}


def measure_layers(layers: int, rows_list: list[int], rounds: int, budget: float) -> None:
    """Prints, per row count, the median seconds of all `layers` layers' products in
    turn, float panel GEMM and quantized kernel alternated (distinct weights each layer)."""
    from minivllm.cpu import _custom_ops as ops
    from minivllm.model.layers.quantization import BLOCK_TYPES

    floats, quants = [], []
    for _, K, N, qtype in LAYER:
        tid = BLOCK_TYPES[qtype].type_id
        blocks = random_blocks(qtype, N, K)
        panels = ops.pack_linear_weight(ops.gguf_dequantize(torch.from_numpy(blocks), tid, K))
        for _ in range(layers):  # copies: the same numbers at other addresses
            floats.append((K, N, panels.clone()))
            quants.append((K, tid, torch.from_numpy(blocks.copy())))
    fbytes = sum(p.numel() * 4 for _, _, p in floats) / layers
    qbytes = sum(b.numel() for _, _, b in quants) / layers
    print(f"# {layers} layers x {len(LAYER)} products: {fbytes * layers / 1e6:.0f} MB of float32 "
          f"panels, {qbytes * layers / 1e6:.0f} MB of blocks")
    print(f"{'rows':>5} {'float ms':>10} {'gguf ms':>10} {'gguf/float speed':>17}")
    for rows in rows_list:
        xs = {K: torch.randn(rows, K, generator=torch.Generator().manual_seed(1))
              for K in {K for K, _, _ in floats}}
        # (a layer's products one after the other, layer after layer)
        fl = [floats[j * layers + i] for i in range(layers) for j in range(len(LAYER))]
        ql = [quants[j * layers + i] for i in range(layers) for j in range(len(LAYER))]
        runs = {"float": lambda: [ops.packed_linear(xs[K], p, N, None) for K, N, p in fl],
                "gguf": lambda: [ops.gguf_linear(xs[K], b, t, None) for K, t, b in ql]}
        times = {k: [] for k in runs}
        for _ in range(rounds):
            for k, fn in runs.items():
                times[k].append(seconds_per_call(fn, budget))
        t = {k: statistics.median(v) for k, v in times.items()}
        print(f"{rows:5} {t['float'] * 1e3:10.2f} {t['gguf'] * 1e3:10.2f} "
              f"{t['float'] / t['gguf']:16.2f}x", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--qtype", default=None, help="one GGML type for every shape "
                   "(default: the default file's, Q4_1 and a Q8_0 head)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.2, help="seconds per timing")
    p.add_argument("--skip-head", action="store_true", help="leave out the 49152-row head")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the "
                   "kernel's own speed, unaffected by a busy machine's descheduled threads)")
    p.add_argument("--layers", type=int, default=0, help="time N layers' products in turn "
                   "(weights streamed from memory) instead of each product on its own")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from minivllm.cpu import _custom_ops as ops
    from minivllm.cpu.features import cpu_features

    ops.build_problem()
    print(f"# {cpu_features().describe()}; torch threads {torch.get_num_threads()}")
    if args.layers:
        return measure_layers(args.layers, args.rows, args.rounds, args.budget)
    print(f"{'product':14} {'K':>5} {'N':>6} {'type':5} {'rows':>5} {'float us':>10} "
          f"{'gguf us':>10} {'gguf/float speed':>17}")
    for name, K, N, qtype in SHAPES:
        if args.skip_head and name == "lm_head":
            continue
        qtype = args.qtype or qtype
        for rows in args.rows:
            t = measure(K, N, qtype, rows, args.rounds, args.budget)
            print(f"{name:14} {K:5} {N:6} {qtype:5} {rows:5} {t['float'] * 1e6:10.1f} "
                  f"{t['gguf'] * 1e6:10.1f} {t['float'] / t['gguf']:16.2f}x", flush=True)


if __name__ == "__main__":
    main()
