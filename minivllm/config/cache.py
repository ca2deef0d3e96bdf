"""The KV-cache section: block size and how many blocks (a count, or a memory budget)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minivllm.config.checks import bad, check_bool, check_int, is_int, is_number

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # explicit count wins over the budget
    kv_cache_memory_bytes: Optional[int] = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9  # CUDA, neither above: worker/kv_sizing.py

    def __post_init__(self) -> None:
        if not is_int(self.block_size) or self.block_size not in BLOCK_SIZES:
            raise bad("block_size", self.block_size, "must be a power of two in [1, 128]")
        check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True,
                  allowed="must be a positive integer")
        check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True,
                  allowed="must be a positive integer")
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if not (is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1):
            raise bad("gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")


__all__ = ["CacheConfig", "BLOCK_SIZES"]
