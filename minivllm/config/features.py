"""The sections of the optional features: LoRA, speculative decoding, KV transfer, KV events,
weight transfer.

``EngineArgs`` loads this module only when one of them is asked for; each
section's own module (``lora.py``, ``speculative.py``, ``kv_transfer.py``,
``kv_events.py``) loads only when its feature is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.config.engine import EngineArgs


def feature_sections(args: EngineArgs) -> dict:
    """``EngineConfig``'s fields for the features ``args`` asks for, checked."""
    sections = {}
    if args.enable_lora is not False:
        from minivllm.config.lora import LoRAConfig

        sections["lora"] = LoRAConfig.from_args(args.enable_lora, args.max_loras,
                                                args.max_lora_rank, args.max_cpu_loras)
    if args.speculative_config is not None:
        from minivllm.config.speculative import SpeculativeConfig

        sections["speculative"] = SpeculativeConfig.from_dict(args.speculative_config)
    if (args.kv_transfer_config, args.kv_offloading_size,
            args.kv_offloading_backend) != (None, None, None):
        from minivllm.config.kv_transfer import KVTransferConfig

        sections["kv_transfer"] = KVTransferConfig.from_engine_args(args)
    if args.kv_events_config is not None:
        from minivllm.config.kv_events import KVEventsConfig

        sections["kv_events"] = KVEventsConfig.from_dict(args.kv_events_config)
    if args.weight_transfer_config is not None:
        from minivllm.config.weight_transfer import WeightTransferConfig

        sections["weight_transfer"] = WeightTransferConfig.from_dict(
            args.weight_transfer_config)
    return sections


__all__ = ["feature_sections"]
