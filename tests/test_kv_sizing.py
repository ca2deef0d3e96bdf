"""KV cache sizing from gpu_memory_utilization (minivllm/worker/kv_sizing.py): the
arithmetic, on numbers worked by hand; the profiling run itself needs CUDA and runs
in ``make gpu-check``."""

from __future__ import annotations

import pytest
import torch

from minivllm.core.kv_cache_interface import FullAttentionSpec
from minivllm.worker.kv_sizing import (MemoryProfile, dummy_step_lengths, kv_cache_bytes,
                                       num_blocks_for)

GIB, MIB = 1 << 30, 1 << 20


def test_h100_sized_example_by_hand():
    # An 80 GiB device at 0.9: 72 GiB for the engine. Weights 15 GiB (an 8B model in
    # bfloat16), the profiled step's peak 2 GiB, the CUDA context and workspaces 1 GiB:
    # 72 - 15 - 2 - 1 = 54 GiB of KV cache.
    profile = MemoryProfile(total=80 * GIB, weights=15 * GIB, peak_activations=2 * GIB,
                            non_torch=1 * GIB)
    assert kv_cache_bytes(profile, 0.9) == 54 * GIB
    # Llama 3 8B: 32 layers, 8 KV heads of 128, bfloat16, blocks of 16 tokens:
    # 2 (K, V) * 16 * 8 * 128 * 2 bytes = 64 KiB per layer, 2 MiB per block.
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128,
                             dtype=torch.bfloat16)
    block_bytes = spec.page_size_bytes * 32
    assert block_bytes == 2 * MIB
    assert num_blocks_for(54 * GIB, block_bytes, profile, 0.9) == 54 * 512  # 27,648 blocks
    # At 0.5 the engine has 40 GiB: 40 - 18 = 22 GiB, 11,264 blocks.
    assert num_blocks_for(kv_cache_bytes(profile, 0.5), block_bytes, profile, 0.5) == 11264


def test_partial_block_is_dropped_and_too_little_is_an_error():
    profile = MemoryProfile(total=1000, weights=300, peak_activations=100, non_torch=0)
    assert kv_cache_bytes(profile, 0.5) == 100  # 500 - 300 - 100
    assert num_blocks_for(100, 30, profile, 0.5) == 3
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.3 leaves .*raise "
                                         r"gpu_memory_utilization"):
        num_blocks_for(kv_cache_bytes(profile, 0.3), 30, profile, 0.3)  # -100 bytes
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        kv_cache_bytes(profile, 1.5)


def test_dummy_step_spreads_the_token_budget():
    assert dummy_step_lengths(2048, 128) == [16] * 128
    assert dummy_step_lengths(10, 4) == [3, 3, 2, 2]
    assert dummy_step_lengths(3, 128) == [1, 1, 1]
    assert sum(dummy_step_lengths(8192, 256)) == 8192
