"""``LoRARequest``: which adapter a request runs with (vLLM's name and fields).

``lora_name`` is what people call it (the server's ``"model"`` field),
``lora_int_id`` the engine's key for it (slots, caches, prefix-cache hashes:
two adapters must never share one), ``lora_path`` the PEFT folder it loads from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name={self.lora_name!r} is invalid: "
                             "must be a non-empty string")
        i = self.lora_int_id
        if not isinstance(i, int) or isinstance(i, bool) or i < 1:
            # 0 would be the base model in vLLM's numbering
            raise ValueError(f"LoRARequest.lora_int_id={i!r} is invalid: must be an "
                             "integer >= 1")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path={self.lora_path!r} is invalid: must "
                             "be the path of a PEFT adapter folder")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


__all__ = ["LoRARequest"]
