"""Refuse a request's adapter before the request is registered anywhere.

The API side reads and checks each adapter once (``peft_loader``), so a bad
one fails the request that names it, never a step of the engine; and one
``lora_int_id`` can only ever mean one adapter, since slots, caches and
prefix-cache hashes are keyed by it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from minivllm.config import InvalidRequestError
from minivllm.lora.request import LoRARequest

if TYPE_CHECKING:
    from minivllm.config import LoRAConfig, ModelConfig


class LoRARequestChecker:
    def __init__(self, lora_config: Optional[LoRAConfig], model_config: ModelConfig) -> None:
        self.lora_config, self.model_config = lora_config, model_config
        self.checked: dict[int, LoRARequest] = {}  # lora_int_id -> the adapter it means

    def check(self, lora_request: Optional[LoRARequest]) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request={lora_request!r} is invalid: must be a "
                                      "minivllm.LoRARequest or None", "lora_request")
        if self.lora_config is None:
            raise InvalidRequestError(f"lora_request={lora_request.lora_name!r} needs an "
                                      "engine started with enable_lora=True (--enable-lora)",
                                      "lora_request")
        known = self.checked.get(lora_request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora_request.lora_name,
                                                      lora_request.lora_path):
                raise InvalidRequestError(
                    f"LoRARequest.lora_int_id={lora_request.lora_int_id} already means "
                    f"adapter {known.lora_name!r} at {known.lora_path!r}: each adapter "
                    "needs its own lora_int_id", "lora_request")
            return
        from minivllm.lora.peft_loader import load_adapter  # torch, safetensors: on first use

        load_adapter(lora_request, self.model_config, self.lora_config.max_lora_rank)
        self.checked[lora_request.lora_int_id] = lora_request

    def forget(self, lora_int_id: int) -> None:
        self.checked.pop(lora_int_id, None)


__all__ = ["LoRARequestChecker"]
