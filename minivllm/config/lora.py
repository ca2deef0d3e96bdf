"""The multi-LoRA section (minivllm/lora/): vLLM's ``enable_lora``, ``max_loras``,
``max_lora_rank`` and ``max_cpu_loras``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minivllm.config.checks import bad, check_bool, check_int


@dataclass
class LoRAConfig:
    """``max_loras`` adapter slots (what one step can mix), each up to ``max_lora_rank``,
    filled from a CPU-side LRU cache of ``max_cpu_loras`` loaded adapters."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    @staticmethod
    def from_args(enable_lora: bool, max_loras: int, max_lora_rank: int,
                  max_cpu_loras: Optional[int]) -> Optional["LoRAConfig"]:
        """None when ``enable_lora`` is False; every field checked otherwise."""
        if not check_bool("enable_lora", enable_lora):
            return None
        check_int("max_loras", max_loras, 1, allowed="must be a positive integer")
        check_int("max_lora_rank", max_lora_rank, 1, allowed="must be a positive integer")
        check_int("max_cpu_loras", max_cpu_loras, 1, optional=True,
                  allowed="must be a positive integer (or None: max_loras)")
        cpu = max_loras if max_cpu_loras is None else max_cpu_loras
        if cpu < max_loras:  # vLLM's rule: every slot's adapter is also cached
            raise bad("max_cpu_loras", cpu, f"must be >= max_loras ({max_loras})")
        return LoRAConfig(max_loras, max_lora_rank, cpu)


__all__ = ["LoRAConfig"]
