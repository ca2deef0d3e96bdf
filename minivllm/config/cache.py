"""The KV-cache section: block size and how many blocks (a count, or a memory budget)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minivllm.config.checks import bad, check_bool, check_int, is_int

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # explicit count wins over the budget
    kv_cache_memory_bytes: Optional[int] = None
    enable_prefix_caching: bool = True
    # On CUDA without a count or budget: the share of the device's memory the engine
    # may take, the KV cache getting what weights and a profiled step leave
    # (worker/kv_sizing.py). vLLM's name and default.
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if not is_int(self.block_size) or self.block_size not in BLOCK_SIZES:
            raise bad("block_size", self.block_size, "must be a power of two in [1, 128]")
        check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True,
                  allowed="must be a positive integer")
        check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True,
                  allowed="must be a positive integer")
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise bad("gpu_memory_utilization", u, "must be a number in (0, 1]")


__all__ = ["CacheConfig", "BLOCK_SIZES"]
