"""CUDA graphs for decode steps: capture once per batch-size bucket, replay each step.

A decode step of a small model on a GPU launches hundreds of kernels that each run
for microseconds; the CPU that launches them one by one becomes the bottleneck. A
CUDA graph records the launches of one forward pass once (``torch.cuda.graph``) and
replays them with one call. A graph is frozen: the same kernels, the same grid
sizes, the same memory addresses. So

* every input lives in a **static buffer** the graph was recorded on (token ids,
  positions, slot mapping, block tables, sequence lengths); before a replay the
  runner copies the step's values into them;
* a graph serves **one batch size**. A step of ``n`` decode tokens is padded up to
  the next captured size (``bucket_for``), and the padding rows must not touch the
  real KV cache: their slot is ``-1`` ("do not store", as vLLM pads), their
  sequence length 1 and their block table zeros, so their attention reads one key
  they wrote nowhere and their output rows are dropped;
* only **decode-only** steps (one new token per sequence) are captured: a prefill
  step's shape (query lengths, tiles) changes every step, and it runs eagerly, as
  does a step larger than the biggest bucket.

The sizes follow vLLM's default list: 1, 2, 4, every multiple of 8 below 256, then
of 16 up to the largest (``max_cudagraph_capture_size``, vLLM's default: twice the
decode tokens a step may hold, at most 512). ``enforce_eager=True`` (vLLM's name) turns graphs off;
the CPU never captures (its decode replay is ``minivllm/cpu/fused_decode.py``).
The graphs need an attention backend whose launches depend only on tensors, not on
Python copies of the lengths: the Triton one (``model/attention/triton_attn.py``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from minivllm.model.attention.backend import AttentionMetadata

# vLLM's cap on the largest captured batch.
MAX_CAPTURE_SIZE_LIMIT = 512


def default_max_capture_size(max_num_seqs: int, num_speculative_tokens: int = 0) -> int:
    """vLLM's default: twice the decode tokens one step may hold, at most 512."""
    return min(2 * max_num_seqs * (1 + num_speculative_tokens), MAX_CAPTURE_SIZE_LIMIT)


def capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, multiples of 8 below 256, then of 16 up to ``max_size`` (itself added
    if it is not one): vLLM's default list."""
    if max_size < 1:
        raise ValueError(f"max_cudagraph_capture_size={max_size} must be >= 1")
    sizes = ([s for s in (1, 2, 4) if s <= max_size] + list(range(8, min(max_size + 1, 256), 8))
             + list(range(256, max_size + 1, 16)))
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def bucket_for(num_tokens: int, sizes: list[int]) -> Optional[int]:
    """The smallest captured size >= ``num_tokens``; None past the largest (eager)."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


def padding_waste(num_tokens: int, sizes: list[int]) -> float:
    """Share of a replayed step's rows that are padding (0 for an eager step)."""
    bucket = bucket_for(num_tokens, sizes)
    return 0.0 if bucket is None else (bucket - num_tokens) / bucket


def graphs_problem(config, attn_backend_name: str, has_lora: bool, has_kv_groups: bool
                   ) -> Optional[str]:
    """Why this engine captures no CUDA graphs, or None: it does."""
    if config.enforce_eager:
        return "enforce_eager=True"
    if torch.device(config.device).type != "cuda":
        return f"device {config.device!r} is not CUDA"
    if attn_backend_name != "triton":
        return (f"attention backend {attn_backend_name!r} launches by Python lengths; "
                "graphs need 'triton'")
    # (A mixture of experts counts each expert's tokens on the host every step.)
    others = {"batch_invariant": config.batch_invariant, "LoRA": has_lora,
              "a mixture of experts": config.model.moe is not None,
              "several KV cache groups": has_kv_groups,
              "tensor parallelism": config.parallel.tensor_parallel_size > 1}
    for name, on in others.items():
        if on:
            return f"{name} is not captured (runs eagerly)"
    return None


@dataclass
class StaticInputs:
    """The buffers every graph reads, sized for the largest bucket."""

    input_ids: torch.Tensor  # int64 [M]
    positions: torch.Tensor  # int64 [M]
    slot_mapping: torch.Tensor  # int64 [M]; -1 on padding rows
    block_tables: torch.Tensor  # int32 [M, max_blocks]; zeros on padding rows
    seq_lens: torch.Tensor  # int32 [M]; 1 on padding rows
    query_start_loc: torch.Tensor  # int32 [M + 1]: 0..M, one token per sequence

    @staticmethod
    def allocate(max_size: int, max_blocks: int, device: torch.device) -> "StaticInputs":
        def zeros(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        return StaticInputs(zeros(max_size, dtype=torch.int64), zeros(max_size, dtype=torch.int64),
                            torch.full((max_size,), -1, dtype=torch.int64, device=device),
                            zeros(max_size, max_blocks, dtype=torch.int32),
                            torch.ones(max_size, dtype=torch.int32, device=device),
                            torch.arange(max_size + 1, dtype=torch.int32, device=device))

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata, bucket: int) -> None:
        """Copy a step of ``n`` decode tokens in; rows n..bucket become padding."""
        n, width = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:bucket].zero_()  # the old step's longer rows, and padding
        # -1 marks a table's unused tail; zero is as good and never read past seq_len.
        self.block_tables[:n, :width].copy_(meta.block_tables.clamp(min=0))
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.seq_lens[n:bucket].fill_(1)

    def metadata(self, bucket: int, max_seq_len: int) -> AttentionMetadata:
        """Views of the first ``bucket`` rows: what the graph of that size reads."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:bucket + 1], seq_lens=self.seq_lens[:bucket],
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            max_query_len=1, max_seq_len=max_seq_len)


class DecodeGraphs:
    """One captured forward per bucket over ``StaticInputs``; ``run`` pads and replays.

    ``capture=False`` keeps everything but the recording: each ``run`` runs the
    model eagerly on the padded static buffers (how the CPU tests check the
    padding; an engine on the CPU never builds this class).
    """

    def __init__(self, model: nn.Module, sizes: list[int], max_blocks: int,
                 max_seq_len: int, device: torch.device, capture: bool = True) -> None:
        self.model, self.sizes, self.max_seq_len = model, sizes, max_seq_len
        self.max_blocks = max_blocks
        self.buffers = StaticInputs.allocate(sizes[-1], max_blocks, device)
        self.capture = capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # steps replayed (make gpu-check reports it)

    def accepts(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode-only step (one token per sequence) that fits a bucket."""
        n = input_ids.shape[0]
        return (meta.max_query_len == 1 and meta.num_seqs == n
                and meta.sliding_window is None
                and meta.block_tables.shape[1] <= self.max_blocks
                and bucket_for(n, self.sizes) is not None)

    def _forward(self, bucket: int) -> torch.Tensor:
        b = self.buffers
        return self.model(b.input_ids[:bucket], b.positions[:bucket],
                          b.metadata(bucket, self.max_seq_len))

    @torch.inference_mode()
    def capture_all(self, on_progress: Optional[Callable[[int], None]] = None) -> None:
        """Record every bucket, largest first, into one shared memory pool (vLLM's
        order: the smaller graphs reuse the largest one's intermediate memory)."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks kernels
            for bucket in (self.sizes[-1], self.sizes[0]):
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for bucket in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            self._forward(bucket)  # one eager run per shape before its recording
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(bucket)
            self.graphs[bucket] = (graph, hidden)
            if on_progress is not None:
                on_progress(bucket)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of an accepted step's ``n`` real rows, [n, hidden]."""
        n = input_ids.shape[0]
        bucket = bucket_for(n, self.sizes)
        self.buffers.fill(input_ids, positions, meta, bucket)
        if bucket in self.graphs:
            graph, hidden = self.graphs[bucket]
            graph.replay()
            self.replays += 1
        else:
            hidden = self._forward(bucket)
        return hidden[:n]


def build_decode_graphs(runner) -> Optional[DecodeGraphs]:
    """The runner's graphs, captured after its KV cache exists, or None (and why, in
    ``runner.cuda_graphs_problem``)."""
    config = runner.config
    runner.cuda_graphs_problem = graphs_problem(
        config, runner.attn_backend.name, runner.lora_manager is not None,
        runner.kv_groups is not None)
    if runner.cuda_graphs_problem is not None:
        return None
    spec = config.speculative
    k = 0 if spec is None else spec.num_speculative_tokens
    max_size = config.max_cudagraph_capture_size or default_max_capture_size(
        config.scheduler.max_num_seqs, k)
    max_len = config.scheduler.max_model_len
    # A table row covers the longest sequence plus its drafts' slots.
    max_blocks = -(-(max_len + k) // runner.block_size) + 1
    graphs = DecodeGraphs(runner.model, capture_sizes(max_size), max_blocks, max_len,
                          runner.device)
    graphs.capture_all()
    return graphs


__all__ = ["capture_sizes", "bucket_for", "padding_waste", "default_max_capture_size",
           "graphs_problem", "StaticInputs", "DecodeGraphs", "build_decode_graphs",
           "MAX_CAPTURE_SIZE_LIMIT"]
