"""``OffloadingConnector``: a second, larger KV tier in host memory, with LRU.

The primary pool keeps freed blocks cached until it needs the room; then it
*evicts* one and its K/V are gone. With this connector an evicted block is
first copied to a host-memory tier (``--kv-offloading-size GiB``), and a later
request whose prefix hash chain continues into the tier gets those blocks
copied back instead of recomputed.

The scheduler half is the tier's bookkeeper: which hash sits in which tier
slot, least recently used first out. It turns each step's evictions into
*stores* (primary block -> tier slot) and each prefix hit into *loads*
(tier slot -> primary block). The worker half only copies, stores before
loads, both before the forward pass, so a primary block evicted and reused
in the same step is saved before anything overwrites it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from minivllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    stores: list[tuple[int, int]] = field(default_factory=list)  # (block id, tier slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (tier slot, block id)


def num_tier_slots(cpu_bytes: int, block_bytes: int) -> int:
    n = cpu_bytes // block_bytes
    if n < 1:
        raise ValueError(f"kv_offloading_size={cpu_bytes / (1 << 30):.6f} GiB is too small: "
                         f"one KV block needs {block_bytes} bytes")
    return n


class OffloadingConnector(KVConnectorBase):
    def __init__(self, config, role, spec) -> None:
        super().__init__(config, role, spec)
        self.num_slots = num_tier_slots(config.kv_connector_extra_config["cpu_bytes"],
                                        spec.block_bytes)
        # Scheduler half: block hash -> tier slot, least recently used first.
        self.tier: OrderedDict[int, int] = OrderedDict()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self._pinned: set[int] = set()  # slots this step loads from: not reusable yet
        self._matched: dict[str, list[int]] = {}
        self._meta_next = OffloadingMetadata()
        self.stats = {"stored_blocks": 0, "hit_blocks": 0, "hit_tokens": 0,
                      "dropped_blocks": 0}
        self.tier_tensor = None  # worker half: [slots, layers, 2, block_size, heads, dim]

    # -- scheduler half ------------------------------------------------------
    def _take_slot(self):
        if self.free_slots:
            return self.free_slots.pop()
        for block_hash, slot in self.tier.items():  # oldest first
            if slot not in self._pinned:
                del self.tier[block_hash]
                return slot
        return None

    def on_block_evicted(self, block_hash: int, block_id: int) -> None:
        if block_hash in self.tier:  # already offloaded earlier: just fresher now
            self.tier.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            self._count("dropped_blocks")
            return
        self.tier[block_hash] = slot
        self._pinned.add(slot)  # written this step: not to be handed out twice
        self._meta_next.stores.append((block_id, slot))
        self._count("stored_blocks")

    def reset_cache(self) -> None:
        """Forget every offloaded block (its K/V may be stale: new weights)."""
        self.tier.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self._pinned, self._matched = set(), {}
        self._meta_next = OffloadingMetadata()

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        if request.sampling_params.prompt_logprobs is not None:
            return 0, False
        bs = self.block_size
        first, last = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        slots = []
        for block_hash in request.block_hashes[first:last]:
            slot = self.tier.get(block_hash)
            if slot is None:
                break
            self.tier.move_to_end(block_hash)
            self._pinned.add(slot)  # the allocation that follows must not reuse it
            slots.append(slot)
        self._matched[request.request_id] = [first] + slots
        return len(slots) * bs, False

    def update_state_after_alloc(self, request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        first, *slots = self._matched.pop(request.request_id, [0])
        if num_external_tokens == 0:
            return
        self._meta_next.loads += zip(slots, block_ids[first:first + len(slots)])
        self._count("hit_blocks", len(slots))
        self._count("hit_tokens", num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> OffloadingMetadata:
        meta, self._meta_next = self._meta_next, OffloadingMetadata()
        self._pinned, self._matched = set(), {}
        return meta

    # -- worker half ---------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        k = kv_caches[0][0]
        pin = k.device.type == "cuda"  # page-locked host memory copies faster to a GPU
        self.tier_tensor = torch.zeros((self.num_slots, len(kv_caches), 2, *k.shape[1:]),
                                       dtype=k.dtype, pin_memory=pin)

    def start_load_kv(self) -> None:
        meta = self._meta
        for block_id, slot in meta.stores:
            for layer, (k, v) in enumerate(self.kv_caches):
                self.tier_tensor[slot, layer, 0].copy_(k[block_id])
                self.tier_tensor[slot, layer, 1].copy_(v[block_id])
        for slot, block_id in meta.loads:
            for layer, (k, v) in enumerate(self.kv_caches):
                k[block_id].copy_(self.tier_tensor[slot, layer, 0])
                v[block_id].copy_(self.tier_tensor[slot, layer, 1])


__all__ = ["OffloadingConnector", "OffloadingMetadata", "num_tier_slots"]
