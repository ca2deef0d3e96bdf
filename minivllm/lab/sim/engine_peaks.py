"""The peaks the engine's own kernels reach here, on the model's own shapes.

``bench roofline``'s probes time PyTorch's kernels: a square float32 matrix
product and a sum over a large tensor. Where minivllm's CPU kernels are on,
the engine multiplies with other kernels (GGUF blocks dequantized in
registers, prepacked panels, oneDNN for bfloat16) and attends with its own
paged decode kernel, and those can beat the probes (MKL's own dispatch on a
non-Intel CPU, for one). A calibration against a probe the engine beats pins
the efficiency at 1 and cannot say how the engine slows as its batches grow.
So ``calibrate`` measures the peaks with the engine's kernels on the loaded
model:

- **matrix products**: the linear layers of one decoder layer, called as
  the engine calls them (the module's ``forward``: quantized method, packed
  weight, whatever it was given at load), on ``rows`` tokens each: FLOP/s by
  row count, a curve (``Hardware.linear_flops_by_rows``). It is not flat:
  the CPU path multiplies up to ``PANEL_MAX_ROWS`` rows with its own panel
  kernel and more with MKL's GEMM, which on some CPUs reaches half of it; one
  efficiency for both would be wrong for one of them.
- **decode attention**: the paged decode kernel over sequences with long
  contexts (``ATTENTION_CONTEXT`` tokens) in the model's KV layout, on
  several caches in turn, so that the K/V read comes from memory, as in a
  step, not from the last call's caches; the peak is K/V bytes read per
  second (decode attention reads each cached key and value once and does
  about 1.5 FLOPs per byte: it is memory-bound).
- **prefill attention**: the CPU backend's prefill path (a padded batch and
  PyTorch's causal SDPA) on one fresh prompt of ``PREFILL_TOKENS`` tokens, in
  FLOP/s. It is compute-bound and far below the matrix products' peak, so
  pricing it at the products' peak made lone prefills of a few hundred tokens
  faster in the simulator than in the engine (the peaks are printed by
  ``simulate calibrate``; figures/records/simulator.md has one machine's).

Where the kernels are off (the reference path), ``engine_peaks`` returns
None and the probes stand.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# Token rows per product: decode batches to the calibration's token budget per step
# (512), and either side of the row count where the CPU path switches kernels.
LINEAR_ROWS = (16, 64, 128, 512)
# Tokens of context per sequence, sequences per call, caches taken in turn.
ATTENTION_CONTEXT = 2048
ATTENTION_SEQS = 8
ATTENTION_CACHES = 4
# Tokens of the fresh prompt whose prefill attention is timed (the token budget).
PREFILL_TOKENS = 512


@dataclass
class EnginePeaks:
    linear_by_rows: tuple  # ((rows, FLOP/s), ...) of one decoder layer's products
    attention_bandwidth: float  # K/V bytes/s of the paged decode kernel
    attention_flops: float  # FLOP/s of the prefill attention (causal, one fresh prompt)

    @property
    def linear_flops(self) -> float:
        return max(f for _, f in self.linear_by_rows)

    def describe(self) -> str:
        curve = ", ".join(f"{r}: {f / 1e9:.0f}" for r, f in self.linear_by_rows)
        return (f"engine kernels: linear GFLOP/s by token rows {{{curve}}} (one decoder "
                f"layer's products), decode attention {self.attention_bandwidth / 1e9:.1f} "
                f"GB/s of K/V ({ATTENTION_SEQS} x {ATTENTION_CONTEXT} tokens), prefill "
                f"attention {self.attention_flops / 1e9:.1f} GFLOP/s ({PREFILL_TOKENS} tokens)")


def linear_rows() -> tuple[int, ...]:
    """``LINEAR_ROWS`` and the panel kernel's last row count and the next (MKL's first)."""
    from minivllm.cpu.prepack import PANEL_MAX_ROWS

    return tuple(sorted({*LINEAR_ROWS, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1}))


def best_time(fn: Callable[[], object], min_seconds: float, repeats: int = 3) -> float:
    """Fastest call of at least ``repeats`` and ``min_seconds`` of calls (after a
    warm-up): on a shared machine the least disturbed one."""
    fn()
    best, start, done = math.inf, time.perf_counter(), 0
    while done < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        done += 1
    return best


def layer_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The matrix products of the first decoder layer (Llama-like models)."""
    from minivllm.model.layers.linear import LinearBase

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no model.layers to measure")
    return [m for m in layers[0].modules() if isinstance(m, LinearBase)]


@torch.inference_mode()
def linear_peaks(model: torch.nn.Module, dtype: torch.dtype, rows=LINEAR_ROWS,
                 min_seconds: float = 0.3) -> tuple[tuple[int, float], ...]:
    """((rows, FLOP/s), ...): one decoder layer's products as the engine computes them.

    Each product is timed on its own (its fastest call) and the layer's time is
    the sum: on a machine shared with other work a whole layer's calls rarely
    all run undisturbed, one product's often does."""
    linears = layer_linears(model)
    flops_per_row = sum(2 * m.in_features * m.out_features for m in linears)
    out = []
    for n in rows:
        seconds = 0.0
        for m in linears:
            x = torch.randn(n, m.in_features).to(dtype)
            seconds += best_time(lambda: m(x), min_seconds)  # noqa: B023 (called here)
        out.append((n, n * flops_per_row / seconds))
    return tuple(out)


def no_slower_with_fewer_rows(curve) -> tuple[tuple[int, float], ...]:
    """The curve with each row count's time capped by any larger row count's: a
    product of fewer rows never takes longer than one of more, whatever the
    kernel, so a point slower than that was measured while other work held the
    cores (on a loaded 2-core machine one point in several can be 10x off)."""
    pts = sorted(curve)
    out, cap = [], float("inf")
    for rows, flops in reversed(pts):
        cap = min(cap, rows / flops)  # seconds per FLOP of one row, times rows
        out.append((rows, rows / cap))
    return tuple(reversed(out))


@torch.inference_mode()
def decode_attention_peak(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                          dtype: torch.dtype, context: int = ATTENTION_CONTEXT,
                          seqs: int = ATTENTION_SEQS, caches: int = ATTENTION_CACHES,
                          min_seconds: float = 0.5) -> float:
    """K/V bytes per second the paged decode kernel (``csrc/paged_attention.cpp``)
    reads over ``seqs`` sequences of ``context`` tokens, ``caches`` caches in turn."""
    from minivllm.cpu import _custom_ops as ops

    blocks_per_seq = -(-context // block_size)
    shape = (seqs * blocks_per_seq, block_size, num_kv_heads, head_dim)
    kv = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(caches)]
    # Each sequence's blocks in a shuffled order, as a paged cache holds them.
    order = torch.randperm(seqs * blocks_per_seq, generator=torch.Generator().manual_seed(0))
    tables = order.view(seqs, blocks_per_seq).to(torch.int32)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    q = torch.randn(seqs, num_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5

    turn = iter(range(1 << 62))

    def call():  # the next cache in turn: its K/V were not read by the last call
        k, v = kv[next(turn) % caches]
        ops.paged_decode_attention(q, k, v, tables, lens, scale)

    elem = torch.tensor([], dtype=dtype).element_size()
    read = 2 * seqs * context * num_kv_heads * head_dim * elem
    return read / best_time(call, min_seconds, repeats=2 * caches)


@torch.inference_mode()
def prefill_attention_peak(num_heads: int, num_kv_heads: int, head_dim: int,
                           dtype: torch.dtype, tokens: int = PREFILL_TOKENS,
                           min_seconds: float = 0.3) -> float:
    """FLOP/s of the CPU backend's prefill attention (``CPUAttentionBackend._prefill``:
    a gather into a padded batch, then PyTorch's causal SDPA) on one fresh prompt of
    ``tokens`` tokens, counted as the cost model counts it (``4 heads d q (q+1) / 2``)."""
    from minivllm.cpu.attention import CPUAttentionBackend, PrefillBatch, head_major_rows

    q = torch.randn(tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim).to(dtype)
    rows = torch.arange(tokens)
    batch = PrefillBatch(1, tokens, tokens, rows, head_major_rows(rows[None], num_kv_heads),
                         False, None, rows, rows)
    out = torch.empty_like(q)
    seconds = best_time(lambda: CPUAttentionBackend._prefill(
        q, k, v, None, None, batch, head_dim ** -0.5, out), min_seconds)
    return 4 * num_heads * head_dim * tokens * (tokens + 1) / 2 / seconds


def engine_peaks(runner, min_seconds: float = 0.2) -> Optional[EnginePeaks]:
    """The engine's kernel peaks for a loaded ``ModelRunner``, or None where the CPU
    kernels are off (then ``bench roofline``'s probes are what the engine runs)."""
    if getattr(runner, "acceleration_problem", "no runner") is not None:
        return None
    if runner.device.type != "cpu" or not runner.kv_caches:
        return None
    attn = runner.model.attention_layers()[0]
    k_cache = runner.kv_caches[0][0]
    curve = linear_peaks(runner.model, runner.dtype, linear_rows(), min_seconds)
    bw = decode_attention_peak(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                               k_cache.shape[1], k_cache.dtype, min_seconds=2 * min_seconds)
    attn_flops = prefill_attention_peak(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                        runner.dtype, min_seconds=min_seconds)
    return EnginePeaks(curve, bw, attn_flops)


__all__ = ["EnginePeaks", "engine_peaks", "linear_peaks", "linear_rows", "decode_attention_peak",
           "layer_linears", "LINEAR_ROWS", "ATTENTION_CONTEXT", "prefill_attention_peak",
           "no_slower_with_fewer_rows"]
