"""Build a connector from ``kv_transfer_config`` for one role."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from minivllm.distributed.kv_transfer.base import KVCacheSpec, KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from minivllm.config import KVTransferConfig

# Name -> module; imported only when used.
_CONNECTORS = {
    "SharedStorageConnector": "minivllm.distributed.kv_transfer.shared_storage",
    "OffloadingConnector": "minivllm.distributed.kv_transfer.offloading",
    "P2pConnector": "minivllm.distributed.kv_transfer.p2p",
}


def create_connector(config: "KVTransferConfig", role: KVConnectorRole,
                     spec: KVCacheSpec) -> KVConnectorBase:
    module = _CONNECTORS.get(config.kv_connector)
    if module is None:
        raise ValueError(f"kv_transfer_config.kv_connector={config.kv_connector!r} is not "
                         f"available in this build; available: {', '.join(_CONNECTORS)}")
    cls = getattr(importlib.import_module(module), config.kv_connector)
    return cls(config, role, spec)


__all__ = ["create_connector"]
