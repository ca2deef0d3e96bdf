"""The KV connector: the seam through which KV blocks leave and enter an engine.

As in vLLM's V1 design, a connector has two halves, built from the same
``kv_transfer_config``:

* the **scheduler half** (``KVConnectorRole.SCHEDULER``, in the engine core)
  answers *how many of this request's prompt tokens can come from outside*
  (``get_num_new_matched_tokens``), is told *which blocks they will land in*
  (``update_state_after_alloc``), and packs each step's work for the worker
  (``build_connector_meta``);
* the **worker half** (``KVConnectorRole.WORKER``, next to the KV tensors)
  loads before the forward (``start_load_kv``, ``wait_for_layer_load``) and
  saves after it (``save_kv_layer``, ``wait_for_save``).

The scheduler counts the tokens a connector supplies as computed: only the
rest of the prompt runs through the model. Connectors here:
``SharedStorageConnector`` (files keyed by block hashes), ``OffloadingConnector``
(a host-memory LRU tier for blocks the primary pool evicts). Nothing in this
package imports ``core``, ``worker``, ``engine`` or ``entrypoints``: requests
arrive as duck-typed objects (``request_id``, ``block_hashes``, ``num_tokens``...).
"""

from minivllm.distributed.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata,
                                                   KVConnectorOutput, KVConnectorRole)
from minivllm.distributed.kv_transfer.factory import create_connector

__all__ = ["KVConnectorBase", "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRole",
           "create_connector"]
