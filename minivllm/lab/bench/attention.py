"""`minivllm bench attention`: the Triton paged kernel, the torch reference and
a contiguous ``scaled_dot_product_attention`` baseline on the same work.

Each shape is a batch of identical sequences (``num_seqs`` x ``query_len``
new tokens after ``context_len`` cached ones), stored in a paged KV cache
whose blocks are shuffled, as they are after a while of serving. The two
paged backends read K/V through block tables; the SDPA baseline gets the
same K/V as contiguous ``[batch, kv_heads, seq_len, head_dim]`` tensors,
i.e. what attention costs without paging. (The torch reference, like the
engine's, computes a prefill without context from the fresh K/V rather than
through the cache.)

Reported per shape and backend:
  time      median of ``--iters`` timed calls after ``--warmup`` untimed ones;
  GB/s      the bytes attention must move at least (K and V of every
            sequence read once, Q read, O written) divided by the time;
  TFLOP/s   4 * num_heads * head_dim * (query, key) pairs attended / time;
  % copy    GB/s relative to a plain large tensor copy measured in the same
            run on the same device: how close a memory-bound decode gets to
            what the memory system delivers.

On CPU the Triton kernel runs only under ``TRITON_INTERPRET=1``, and then on
tiny shapes: the interpreter executes each program in numpy, so its times
say nothing about the kernel, only that it runs.

``gpu_check()`` (``--gpu-check``) first compares Triton with the torch
reference on mixed prefill + decode launches in every dtype, then runs the
benchmark and writes ``figures/attention_bench_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from minivllm.model.attention.backend import AttentionBackend, AttentionMetadata
from minivllm.model.attention.triton_check import triton_problem
from minivllm.model.attention.torch_attn import TorchAttentionBackend

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Largest max |triton - reference| accepted by gpu_check, against a float32
# reference computed from the same (rounded) inputs: about one unit in the
# last place of outputs of magnitude ~2-4 in the 16-bit types.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 4e-3, torch.bfloat16: 3e-2}


# --------------------------------------------------------------------------
# A paged batch: the inputs one attention call sees in the engine
# --------------------------------------------------------------------------

@dataclass
class PagedBatch:
    q: torch.Tensor           # [num_tokens, num_heads, head_dim]: the new tokens
    k: torch.Tensor           # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor
    k_cache: torch.Tensor     # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence, all seq_len keys, contiguous
    values: list[torch.Tensor]


def make_paged_batch(query_lens: list[int], context_lens: list[int], *, num_heads: int,
                     num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     seed: int = 0, spare_blocks: int = 3, garbage: float = 1e4) -> PagedBatch:
    """Random Q/K/V for sequences with cached context, K/V already in a paged cache.

    Physical blocks are a random permutation, so neighbours in a sequence
    are far apart in memory. Every slot no sequence owns holds ``garbage``
    (a large value, or NaN): a kernel that reads outside a sequence shows it.
    Block 0 is always one of the ``spare_blocks`` (>= 1), never used, so a
    padded table entry or a masked lookup that lands on it reads garbage.
    Both the context and the new tokens are in the cache, as they are when
    the engine calls ``forward`` after ``write_kv``.
    """
    if len(query_lens) != len(context_lens):
        raise ValueError(f"query_lens ({len(query_lens)}) and context_lens ({len(context_lens)}) "
                         "must have the same length")
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seq_lens = [c + q for q, c in zip(query_lens, context_lens)]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    if spare_blocks < 1:
        raise ValueError(f"spare_blocks={spare_blocks} must be >= 1 (block 0 stays unused)")
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, garbage, dtype=dtype, device=device)
    v_cache = torch.full(cache_shape, garbage, dtype=dtype, device=device)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq, default=0) + 1), -1,
                              dtype=torch.int32)
    keys, values, new_k, new_v, new_slots, all_slots = [], [], [], [], [], []
    for i, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        table = [physical.pop() for _ in range(n_blocks)]
        block_tables[i, :n_blocks] = torch.tensor(table, dtype=torch.int32)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        kv = torch.randn(2, seq_len, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        keys.append(kv[0])
        values.append(kv[1])
        new_k.append(kv[0][context_lens[i]:])
        new_v.append(kv[1][context_lens[i]:])
        new_slots += slots[context_lens[i]:]
        all_slots += slots
    TorchAttentionBackend().write_kv(torch.cat(keys), torch.cat(values), k_cache, v_cache,
                                     torch.tensor(all_slots, dtype=torch.int64, device=device))

    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype).to(device)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
    return PagedBatch(q, torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, meta, keys, values)


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------

@dataclass
class Shape:
    name: str
    num_seqs: int
    query_len: int
    context_len: int

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len

    def pairs(self) -> int:
        """(query, key) pairs attended under the causal mask, all sequences."""
        q, c = self.query_len, self.context_len
        return self.num_seqs * (q * c + q * (q + 1) // 2)


def shapes_for(device: torch.device, interpreted_triton: bool) -> list[Shape]:
    if device.type == "cuda":
        return [Shape("decode", 64, 1, 4096), Shape("decode-many", 256, 1, 1024),
                Shape("prefill", 4, 2048, 0)]
    if interpreted_triton:
        return [Shape("decode", 4, 1, 128), Shape("prefill", 1, 64, 0)]
    return [Shape("decode", 16, 1, 512), Shape("prefill", 2, 256, 0)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds per call. CUDA events on a GPU, so launch gaps are not counted."""
    for _ in range(warmup):
        fn()
    _synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, warmup: int = 3, iters: int = 10) -> float:
    """Bytes/s of a large device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, warmup, iters)
    return 2 * nbytes / seconds


def _sdpa_call(batch: PagedBatch, shape: Shape, scale: float) -> Callable[[], torch.Tensor]:
    """Contiguous baseline: [B, H, Lq, D] queries against [B, Hkv, L, D] keys."""
    b, lq, lk = shape.num_seqs, shape.query_len, shape.seq_len
    q = batch.q.view(b, lq, *batch.q.shape[1:]).transpose(1, 2).contiguous()
    k = torch.stack(batch.keys).transpose(1, 2).contiguous()
    v = torch.stack(batch.values).transpose(1, 2).contiguous()
    gqa = q.shape[1] != k.shape[1]
    if lq > 1 and lq != lk:
        raise ValueError(f"shape {shape.name!r}: the SDPA baseline supports decode "
                         f"(query_len 1) or prefill without context, got {shape}")
    causal = lq > 1
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                  enable_gqa=gqa)


def bench_shape(shape: Shape, backends: dict[str, AttentionBackend], *, num_heads: int,
                num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                device: torch.device, warmup: int, iters: int, copy_bps: float) -> dict:
    batch = make_paged_batch([shape.query_len] * shape.num_seqs,
                             [shape.context_len] * shape.num_seqs,
                             num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=device)
    scale = head_dim ** -0.5
    elem = batch.q.element_size()
    num_tokens = shape.num_seqs * shape.query_len
    nbytes = (2 * shape.num_seqs * shape.seq_len * num_kv_heads * head_dim  # K and V
              + 2 * num_tokens * num_heads * head_dim) * elem                # Q and O
    flops = 4 * num_heads * head_dim * shape.pairs()

    calls: dict[str, Callable[[], object]] = {
        name: (lambda be=be: be.forward(batch.q, batch.k, batch.v, batch.k_cache,
                                        batch.v_cache, batch.meta, scale))
        for name, be in backends.items()}
    calls["sdpa"] = _sdpa_call(batch, shape, scale)
    results = {}
    for name, fn in calls.items():
        seconds = time_call(fn, device, warmup, iters)
        results[name] = {
            "time_ms": seconds * 1e3,
            "bandwidth_gbps": nbytes / seconds / 1e9,
            "tflops": flops / seconds / 1e12,
            "pct_copy_bandwidth": 100 * nbytes / seconds / copy_bps,
        }
    return {**asdict(shape), "bytes": nbytes, "flops": flops, "results": results}


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--num-heads", type=int, default=None,
                        help="query heads (default: 32 on cuda, 8 on cpu, 4 interpreted)")
    parser.add_argument("--num-kv-heads", type=int, default=None,
                        help="KV heads (default: 8 on cuda, 2 on cpu, 1 interpreted)")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="default: 128 on cuda, 64 on cpu")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--shapes", choices=["all", "decode", "prefill"], default="all",
                        help="which shapes to run (decode-heavy, prefill-heavy, or both)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=None,
                        help="timed calls per measurement (default: 20 on cuda, 3 on cpu)")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument("--gpu-check", action="store_true",
                        help="check triton against torch on a few shapes, then benchmark and "
                             "write figures/attention_bench_<device>.json (or --output)")
    parser.add_argument("--quiet", action="store_true", help="do not print the table")


def _given_or(value: Optional[int], default: int) -> int:
    return default if value is None else value


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return value


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark described by parsed ``add_cli_args`` arguments; return the results."""
    if getattr(args, "gpu_check", False):
        return gpu_check(output=args.output, device=args.device, quiet=args.quiet)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]

    backends: dict[str, AttentionBackend] = {}
    notes = []
    problem = triton_problem(device)
    interpreted = not cuda and problem is None
    if problem is None:
        from minivllm.model.attention.triton_attn import TritonAttentionBackend
        backends["triton"] = TritonAttentionBackend()
        if interpreted:
            note = ("triton runs under TRITON_INTERPRET=1 (numpy, one program at a time): "
                    "tiny shapes only, and its times say nothing about the kernel")
            warnings.warn(note, RuntimeWarning, stacklevel=2)
            notes.append(note)
    else:
        notes.append(f"triton skipped: {problem}")
    backends["torch"] = TorchAttentionBackend()

    num_heads = _positive("num_heads",
                          _given_or(args.num_heads, 32 if cuda else 4 if interpreted else 8))
    num_kv_heads = _positive("num_kv_heads",
                             _given_or(args.num_kv_heads, 8 if cuda else 1 if interpreted else 2))
    head_dim = _positive("head_dim", _given_or(args.head_dim, 128 if cuda else 64))
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    iters = _positive("iters", _given_or(args.iters, 20 if cuda else 3))
    block_size = _positive("block_size", args.block_size)
    shapes = [s for s in shapes_for(device, interpreted)
              if args.shapes == "all" or s.name.startswith(args.shapes)]

    copy_bps = copy_bandwidth(device, (1 << 30) if cuda else (64 << 20))
    results = {
        "device": device_name(device), "device_type": device.type,
        "dtype": str(dtype).replace("torch.", ""), "torch_version": torch.__version__,
        "triton_version": _triton_version(), "triton_interpreted": interpreted,
        "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "block_size": block_size, "warmup": args.warmup, "iters": iters,
        "copy_bandwidth_gbps": copy_bps / 1e9, "notes": notes,
        "shapes": [bench_shape(s, backends, num_heads=num_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, block_size=block_size, dtype=dtype,
                               device=device, warmup=args.warmup, iters=iters, copy_bps=copy_bps)
                   for s in shapes],
    }
    if not args.quiet:
        print(format_table(results))
    if args.output:
        _write_json(results, args.output)
    return results


def format_table(results: dict) -> str:
    lines = [f"attention on {results['device']} ({results['dtype']}, heads "
             f"{results['num_heads']}/{results['num_kv_heads']}, head_dim {results['head_dim']}, "
             f"block {results['block_size']}); copy bandwidth "
             f"{results['copy_bandwidth_gbps']:.1f} GB/s",
             f"{'shape':<12} {'seqs':>5} {'q_len':>6} {'ctx':>6} {'backend':<8} "
             f"{'ms':>9} {'GB/s':>9} {'% copy':>7} {'TFLOP/s':>8}"]
    for s in results["shapes"]:
        for name, r in s["results"].items():
            lines.append(f"{s['name']:<12} {s['num_seqs']:>5} {s['query_len']:>6} "
                         f"{s['context_len']:>6} {name:<8} {r['time_ms']:>9.3f} "
                         f"{r['bandwidth_gbps']:>9.1f} {r['pct_copy_bandwidth']:>6.1f}% "
                         f"{r['tflops']:>8.3f}")
    lines += [f"note: {n}" for n in results["notes"]]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# GPU check: correctness first, then the numbers
# --------------------------------------------------------------------------

def check_against_torch(device: torch.device, reduced: bool) -> list[dict]:
    """Max |triton - torch float32 reference| per dtype, layout and launch.

    Two launches per layout, both with shuffled blocks: "mixed" holds a
    prefill without context, prefill chunks after cached context and decode
    tokens; "decode" holds only decode tokens (the kernel's other tile
    shape). write_kv is checked too: the Triton-written cache must equal the
    torch-written one.
    """
    from minivllm.model.attention.triton_attn import TritonAttentionBackend
    triton_backend, reference = TritonAttentionBackend(), TorchAttentionBackend()
    if reduced:
        layouts = [(16, 64, 1, 2)]                       # block, head_dim, group, kv_heads
        launches = {"mixed": ([9, 1, 20, 1], [0, 40, 33, 7]), "decode": ([1, 1], [70, 5])}
    else:
        layouts = [(16, 64, 1, 8), (16, 128, 4, 8), (32, 128, 8, 4), (16, 128, 7, 2)]
        launches = {"mixed": ([300, 1, 1, 70, 1, 128, 1, 5],
                              [0, 4000, 17, 1000, 1, 2000, 257, 96]),
                    "decode": ([1] * 6, [0, 15, 16, 1023, 4095, 333])}
    checks = []
    for dtype in DTYPES.values():
        for block_size, head_dim, group, num_kv_heads in layouts:
            for launch, (query_lens, context_lens) in launches.items():
                batch = make_paged_batch(query_lens, context_lens,
                                         num_heads=group * num_kv_heads,
                                         num_kv_heads=num_kv_heads, head_dim=head_dim,
                                         block_size=block_size, dtype=dtype, device=device)
                diff = _max_diff_to_reference(triton_backend, reference, batch)
                kv_equal = _write_kv_equal(triton_backend, batch)
                checks.append({
                    "dtype": str(dtype).replace("torch.", ""), "block_size": block_size,
                    "head_dim": head_dim, "group_size": group, "num_kv_heads": num_kv_heads,
                    "launch": launch, "query_lens": query_lens, "context_lens": context_lens,
                    "max_abs_diff": diff, "tolerance": TOLERANCE[dtype],
                    "write_kv_equal": kv_equal,
                    "ok": bool(diff <= TOLERANCE[dtype] and kv_equal)})
    return checks


def _max_diff_to_reference(backend: AttentionBackend, reference: AttentionBackend,
                           batch: PagedBatch) -> float:
    scale = batch.q.shape[-1] ** -0.5
    out = backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache,
                          batch.meta, scale)
    ref = reference.forward(batch.q.float(), batch.k.float(), batch.v.float(),
                            batch.k_cache.float(), batch.v_cache.float(), batch.meta, scale)
    return (out.float() - ref).abs().max().item()


def _write_kv_equal(backend: AttentionBackend, batch: PagedBatch) -> bool:
    """Blank the new tokens' slots, let ``backend`` write them back, compare."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    k_cache.view(-1, *k_cache.shape[2:])[batch.meta.slot_mapping] = 0
    v_cache.view(-1, *v_cache.shape[2:])[batch.meta.slot_mapping] = 0
    backend.write_kv(batch.k, batch.v, k_cache, v_cache, batch.meta.slot_mapping)
    return torch.equal(k_cache, batch.k_cache) and torch.equal(v_cache, batch.v_cache)


def gpu_check(output: Optional[str] = None, device: Optional[str] = None,
              quiet: bool = False) -> dict:
    """Correctness of Triton vs torch, then the benchmark; writes a JSON file.

    On CUDA: full cases and shapes, file ``figures/attention_bench_<gpu>.json``.
    On CPU (reduced): the checks run only under TRITON_INTERPRET=1 and on a
    small case; the benchmark uses the CPU shapes. Raises RuntimeError after
    writing the file if any check fails.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    reduced = dev.type != "cuda"
    problem = triton_problem(dev)
    checks = check_against_torch(dev, reduced) if problem is None else []
    args = argparse.Namespace(device=str(dev), dtype=None, num_heads=None, num_kv_heads=None,
                              head_dim=None, block_size=16, shapes="all", warmup=3, iters=None,
                              output=None, gpu_check=False, quiet=quiet)
    bench = run(args)
    result = {"device": device_name(dev), "reduced": reduced,
              "triton_problem": problem, "checks": checks,
              "correct": all(c["ok"] for c in checks) if checks else None,
              "bench": bench}
    slug = "cpu" if reduced else _slug(result["device"])
    path = output or f"figures/attention_bench_{slug}.json"
    _write_json(result, path)
    if not quiet:
        for c in checks:
            print(f"check {c['dtype']:<9} {c['launch']:<6} block {c['block_size']:>2} "
                  f"head_dim {c['head_dim']:>3} group {c['group_size']}: "
                  f"max |diff| {c['max_abs_diff']:.2e} "
                  f"(tol {c['tolerance']:.0e}), write_kv equal {c['write_kv_equal']}"
                  f" -> {'ok' if c['ok'] else 'FAIL'}")
        print(f"wrote {path}")
    if checks and not result["correct"]:
        raise RuntimeError(f"triton attention disagrees with the torch reference; see {path}")
    return result


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _write_json(data: dict, path: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m minivllm.lab.bench.attention [--gpu-check]``."""
    parser = argparse.ArgumentParser(
        description="Paged attention: Triton kernel vs torch reference vs contiguous SDPA.")
    add_cli_args(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
