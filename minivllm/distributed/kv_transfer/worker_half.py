"""The worker half of a KV connector as the model runner uses it: built next to the
KV tensors, and wrapped around each step's forward.

On a CPU there is no copy engine to overlap with, so every layer's load is
awaited before the forward and every layer is saved once the pass is done, in
vLLM's per-layer calls (``wait_for_layer_load``, ``save_kv_layer``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from minivllm.distributed.kv_transfer.base import (KVCacheSpec, KVConnectorBase,
                                                   KVConnectorOutput, KVConnectorRole)
from minivllm.distributed.kv_transfer.factory import create_connector


def make_worker_connector(config, block_size: int, block_bytes: int,
                          kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> KVConnectorBase:
    """``kv_transfer_config``'s worker half, holding the runner's K/V tensors."""
    spec = KVCacheSpec(block_size, len(kv_caches), block_bytes)
    connector = create_connector(config, KVConnectorRole.WORKER, spec)
    connector.register_kv_caches(kv_caches)
    return connector


def forward_with_connector(connector: KVConnectorBase, metadata, finished_req_ids,
                           kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                           forward: Optional[Callable[[], torch.Tensor]]
                           ) -> tuple[Optional[torch.Tensor], KVConnectorOutput]:
    """External blocks land first, then ``forward()`` runs (None: no forward this
    step, transfers still progress), then the step's K/V are saved; returns the
    logits and the connector's news (transfers done, loads failed)."""
    logits = None
    connector.bind_connector_metadata(metadata)
    try:
        connector.start_load_kv()
        if forward is not None:
            for layer in range(len(kv_caches)):
                connector.wait_for_layer_load(layer)
            logits = forward()
            for layer, (k, v) in enumerate(kv_caches):
                connector.save_kv_layer(layer, k, v)
            connector.wait_for_save()
        sent, received = connector.get_finished(finished_req_ids)
        return logits, KVConnectorOutput(sent, received,
                                         connector.get_block_ids_with_load_errors())
    finally:
        connector.clear_connector_metadata()


def connector_forward(runner, so, forward: Optional[Callable], out) -> Callable:
    """The runner's step (``forward(inputs)``; None: none this step) inside the runner's
    connector; the connector's news go to ``out.kv_connector_output``."""
    def run(inputs) -> Optional[torch.Tensor]:
        logits, out.kv_connector_output = forward_with_connector(
            runner.kv_connector, so.kv_connector_metadata, so.finished_req_ids,
            runner.kv_caches, None if forward is None else lambda: forward(inputs))
        return logits
    return run


__all__ = ["make_worker_connector", "forward_with_connector", "connector_forward"]
