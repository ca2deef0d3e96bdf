"""How many KV blocks fit on a GPU: the arithmetic, and the profiling run that feeds it.

vLLM's rule (``gpu_memory_utilization``, default 0.9): the engine may take that
share of the device's whole memory. Out of it come

* the weights (measured after loading),
* the peak of a step's activations, measured by running one dummy forward of the
  largest step the scheduler may send (``max_num_batched_tokens`` tokens over up
  to ``max_num_seqs`` sequences, their logits included),
* memory torch does not allocate but the process holds (the CUDA context, the
  libraries' workspaces),

and the KV cache gets the rest, in whole blocks. The rest of the device (10 % by
default) is headroom: the CUDA graphs' pool, fragmentation, other processes.

``kv_cache_bytes`` and ``num_blocks_for`` are pure functions (tested on the CPU
with numbers worked by hand); ``profile_kv_blocks`` measures on CUDA. An explicit
``num_kv_blocks`` or ``kv_cache_memory_bytes`` skips all of this; the CPU keeps its
fixed budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryProfile:
    """What a profiling run measured, in bytes."""

    total: int  # the device's memory
    weights: int  # torch's allocations after loading, before the dummy step
    peak_activations: int  # the dummy step's peak above the weights
    non_torch: int  # held by the process outside torch's allocator (context, workspaces)


def kv_cache_bytes(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV cache: total * utilization - weights - activations - non-torch."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    budget = int(profile.total * gpu_memory_utilization)
    return budget - profile.weights - profile.peak_activations - profile.non_torch


def num_blocks_for(available_bytes: int, block_bytes: int, profile: MemoryProfile,
                   gpu_memory_utilization: float) -> int:
    """Whole blocks in ``available_bytes``; raises, with the numbers, when not one fits."""
    blocks = max(available_bytes, 0) // block_bytes
    if blocks < 1:
        gib = 1 << 30
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves "
            f"{available_bytes / gib:.2f} GiB for the KV cache (device {profile.total / gib:.1f}"
            f" GiB, weights {profile.weights / gib:.2f} GiB, peak activations "
            f"{profile.peak_activations / gib:.2f} GiB, other {profile.non_torch / gib:.2f} GiB)"
            f"; one block needs {block_bytes} bytes: raise gpu_memory_utilization, or lower "
            "max_num_batched_tokens / max_num_seqs")
    return blocks


def dummy_step_lengths(max_num_batched_tokens: int, max_num_seqs: int) -> list[int]:
    """The profiled step: the token budget spread as evenly as it goes over the most
    sequences a step holds (as vLLM's dummy run does)."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    base, extra = divmod(max_num_batched_tokens, num_seqs)
    return [base + (i < extra) for i in range(num_seqs)]


@torch.inference_mode()
def profile_memory(runner) -> MemoryProfile:
    """Run the largest step once, without a KV cache, and read the peaks (CUDA only)."""
    from minivllm.model.attention.backend import AttentionMetadata

    device, sched = runner.device, runner.config.scheduler
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    lengths = dummy_step_lengths(sched.max_num_batched_tokens, sched.max_num_seqs)
    meta = AttentionMetadata.for_prefill(lengths, device)
    ids = torch.zeros(sum(lengths), dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    hidden = runner.model(ids, positions, meta)
    last_rows = torch.tensor(meta.query_start_loc_cpu[1:], device=device) - 1
    runner.model.compute_logits(hidden[last_rows]).float().softmax(-1)  # the sampler's too
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    del hidden
    torch.cuda.empty_cache()
    return MemoryProfile(total, weights, peak - weights, non_torch)


def profile_kv_blocks(runner) -> int:
    """The KV blocks for this runner's model on its CUDA device."""
    profile = profile_memory(runner)
    util = runner.config.cache.gpu_memory_utilization
    return num_blocks_for(kv_cache_bytes(profile, util), runner.kv_block_bytes(), profile, util)


__all__ = ["MemoryProfile", "kv_cache_bytes", "num_blocks_for", "dummy_step_lengths",
           "profile_memory", "profile_kv_blocks"]
