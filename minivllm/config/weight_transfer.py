"""vLLM's ``weight_transfer_config``: how a trainer in another process sends new
weights into the running engine (``minivllm/distributed/weight_transfer.py``).

``LLM(..., weight_transfer_config={"backend": "gloo"})`` (``--weight-transfer-config
'{"backend": "gloo"}'`` on ``minivllm serve``). vLLM's backends are GPU
transports (``nccl``, CUDA IPC); minivllm has ``gloo``, torch.distributed's CPU
collectives over TCP, which also carries CPU tensors from a CUDA trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from minivllm.config.checks import check_choice

WEIGHT_TRANSFER_BACKENDS = ("gloo",)


@dataclass
class WeightTransferConfig:
    backend: str = "gloo"

    @staticmethod
    def from_dict(raw: Any) -> Optional["WeightTransferConfig"]:
        """The checked section, or None when no transfer is configured."""
        if raw is None:
            return None
        from minivllm.config.dict_args import config_dict

        raw = config_dict("weight_transfer_config", raw,
                          [f.name for f in fields(WeightTransferConfig)], '{"backend": "gloo"}')
        config = WeightTransferConfig(**raw)
        check_choice("weight_transfer_config.backend", config.backend, WEIGHT_TRANSFER_BACKENDS)
        return config


__all__ = ["WEIGHT_TRANSFER_BACKENDS", "WeightTransferConfig"]
