"""The V1 KV connector interface: a scheduler half and a worker half.

One class carries both halves; an instance is built for one role and only
that half is called on it. The engine core calls the scheduler half inside
``Scheduler.schedule`` and ``update_from_output``; the model runner calls the
worker half around its forward pass. What crosses between them each step is
the ``KVConnectorMetadata`` built by ``build_connector_meta`` (it travels in
``SchedulerOutput.kv_connector_metadata``, as in vLLM).

Requests are duck-typed: a connector reads ``request_id``, ``prompt_token_ids``,
``num_tokens``, ``block_hashes`` (the prefix cache's hash chain over full
blocks) and ``sampling_params``, and never imports the engine's classes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    import torch

    from minivllm.config import KVTransferConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"  # in the engine core, beside the scheduler
    WORKER = "worker"  # in the model runner, beside the KV tensors


@dataclass
class KVConnectorMetadata:
    """One step's instructions from the scheduler half to the worker half."""


@dataclass
class KVConnectorOutput:
    """One step's news from the worker half back to the scheduler half."""

    finished_sending: set[str] = field(default_factory=set)  # blocks may be freed
    finished_recving: set[str] = field(default_factory=set)  # KV arrived (or failed)
    invalid_block_ids: set[int] = field(default_factory=set)  # loads that failed

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


@dataclass
class KVCacheSpec:
    """What a connector needs to know about the paged KV cache (plain numbers)."""

    block_size: int
    num_layers: int
    block_bytes: int  # one block over all layers, K and V


class KVConnectorBase:
    def __init__(self, config: "KVTransferConfig", role: KVConnectorRole,
                 spec: KVCacheSpec) -> None:
        self.config = config
        self.role = role
        self.spec = spec
        self.block_size = spec.block_size
        self._meta: Optional[KVConnectorMetadata] = None
        # Worker half: per layer (K, V), each [num_blocks, block_size, kv_heads, head_dim].
        self.kv_caches: list[tuple["torch.Tensor", "torch.Tensor"]] = []
        # Counters for metrics and the book (tokens, blocks), per connector.
        self.stats: dict[str, int] = {}

    def _count(self, name: str, n: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + n

    # ------------------------------------------------------------------
    # Scheduler half
    # ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Prompt tokens past ``num_computed_tokens`` (the local prefix-cache hit)
        that this connector can supply, and whether they arrive asynchronously
        (True: the request waits, holding its blocks, until the worker reports
        them received). Never all of the prompt: the last token must be computed
        to sample from."""
        return 0, False

    def update_state_after_alloc(self, request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """The request's whole block table once blocks for the external tokens exist."""

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """This step's loads and saves for the worker half; resets per-step state."""
        return KVConnectorMetadata()

    def on_block_evicted(self, block_hash: int, block_id: int) -> None:
        """The primary pool is about to reuse a cached block (its K/V still intact)."""

    def request_finished(self, request, block_ids: Sequence[int]
                         ) -> tuple[bool, Optional[dict]]:
        """A request ended. Returns (keep its blocks until the worker says they were
        sent, ``kv_transfer_params`` for the response)."""
        return False, None

    def reset_cache(self) -> None:
        """The prefix cache was reset (new weights): forget any blocks of its own."""

    def request_load_failed(self, request) -> None:
        """The worker could not load this request's blocks: never offer them again."""

    # ------------------------------------------------------------------
    # Worker half
    # ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[tuple["torch.Tensor", "torch.Tensor"]]
                           ) -> None:
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, meta: Optional[KVConnectorMetadata]) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        """Begin loading this step's external blocks into the paged cache (before
        the forward pass, which reads them)."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s blocks have landed."""

    def save_kv_layer(self, layer_idx: int, k_cache: "torch.Tensor",
                      v_cache: "torch.Tensor") -> None:
        """Layer ``layer_idx``'s K/V of this step are written: start saving them."""

    def wait_for_save(self) -> None:
        """Block until every save of this step is done (before its blocks can be reused)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose blocks were all sent, requests whose blocks all arrived)."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of this step whose load failed (their contents are not trusted)."""
        return set()

    def shutdown(self) -> None:
        pass


__all__ = ["KVConnectorBase", "KVConnectorMetadata", "KVConnectorRole", "KVCacheSpec",
           "KVConnectorOutput"]
