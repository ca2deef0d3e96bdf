"""``SharedStorageConnector``: a prompt's KV blocks as files, keyed by block hash.

vLLM's example connector, and the simplest way to see KV leave one engine and
enter another: a producer writes each full prompt block it computes to
``<shared_storage_path>/<block hash>.kvblock``; a consumer (another process,
or a later run) that meets the same hash chain loads the files into its own
paged cache instead of running those tokens through the model. The hash
chains the whole prefix, so equal names mean equal K/V.

A file carries the SHA-256 of its tensor. A missing file stops the match
(the scheduler half checks existence); a corrupt or truncated one is caught
when the worker half loads it, reported as a load error, and the scheduler
recomputes the request from scratch: nothing read from disk is trusted
without its checksum.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from minivllm.distributed.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata,
                                                   KVConnectorRole)

SUFFIX = ".kvblock"


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    # (block hash, destination block id) to read before the forward pass.
    loads: list[tuple[int, int]] = field(default_factory=list)
    # (block hash, source block id) to write after it.
    saves: list[tuple[int, int]] = field(default_factory=list)


def block_file(folder: Path, block_hash: int) -> Path:
    return folder / f"{block_hash:064x}{SUFFIX}"


def _digest(data: torch.Tensor) -> str:
    return hashlib.sha256(data.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def write_block(path: Path, block_hash: int, data: torch.Tensor) -> None:
    """Write atomically (temp file + rename): a reader never sees half a block."""
    data = data.detach().to("cpu").contiguous()
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        torch.save({"block_hash": f"{block_hash:064x}", "sha256": _digest(data),
                    "data": data}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_block(path: Path, block_hash: int, shape: tuple, dtype: torch.dtype
               ) -> Optional[torch.Tensor]:
    """The block's [layers, 2, block_size, kv_heads, head_dim] tensor, or None if the
    file is missing, unreadable, for another block, shaped wrong or fails its checksum."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
        data = raw["data"]
        ok = (raw["block_hash"] == f"{block_hash:064x}" and tuple(data.shape) == shape
              and data.dtype == dtype and raw["sha256"] == _digest(data))
    except Exception:  # a damaged file can fail anywhere in unpickling
        return None
    return data if ok else None


class SharedStorageConnector(KVConnectorBase):
    def __init__(self, config, role, spec) -> None:
        super().__init__(config, role, spec)
        self.folder = Path(config.kv_connector_extra_config["shared_storage_path"])
        if config.is_kv_producer:
            self.folder.mkdir(parents=True, exist_ok=True)
        # Scheduler half: request_id -> (first block, block count) matched on disk,
        # then -> (hash, block id) loads once blocks are allocated.
        self._matched: dict[str, tuple[int, int]] = {}
        self._loads: list[tuple[int, int]] = []
        self._failed: set[str] = set()
        # Worker half: this step's saves, and per layer the saved blocks' K and V.
        self._layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._load_errors: set[int] = set()

    # -- scheduler half ------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        if (not self.config.is_kv_consumer or request.request_id in self._failed
                or request.sampling_params.prompt_logprobs is not None):
            return 0, False
        bs = self.block_size
        first = num_computed_tokens // bs
        last = (request.num_tokens - 1) // bs  # the last token is always computed
        n = 0
        for block_hash in request.block_hashes[first:last]:
            if not block_file(self.folder, block_hash).is_file():
                break
            n += 1
        self._matched[request.request_id] = (first, n)
        return n * bs, False

    def update_state_after_alloc(self, request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        first, n = self._matched.pop(request.request_id, (0, 0))
        if num_external_tokens == 0:
            return
        hashes = request.block_hashes[first:first + n]
        self._loads += zip(hashes, block_ids[first:first + n])
        self._count("loaded_tokens", num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> SharedStorageMetadata:
        meta = SharedStorageMetadata(loads=self._loads)
        self._loads, self._matched = [], {}
        if not self.config.is_kv_producer:
            return meta
        so, bs = scheduler_output, self.block_size
        new = set(so.new_req_ids)
        for req in so.scheduled_requests:
            rid = req.request_id
            before = so.num_computed_tokens[rid]
            # Full prompt blocks done by the end of this step (on admission the
            # ones found cached or loaded too: the store may not have them).
            start = 0 if rid in new else before // bs
            end = min(before + so.num_scheduled_tokens[rid], req.num_prompt_tokens) // bs
            meta.saves += zip(req.block_hashes[start:end], so.block_ids[rid][start:end])
        return meta

    def request_load_failed(self, request) -> None:
        self._failed.add(request.request_id)
        self._count("load_failures")

    def request_finished(self, request, block_ids) -> tuple[bool, Optional[dict]]:
        self._failed.discard(request.request_id)
        self._matched.pop(request.request_id, None)
        return False, None

    # -- worker half ---------------------------------------------------------
    def _block_shape(self) -> tuple:
        k = self.kv_caches[0][0]
        return (len(self.kv_caches), 2, *k.shape[1:])

    def bind_connector_metadata(self, meta) -> None:
        super().bind_connector_metadata(meta)
        # Blocks already in the store are not written again.
        meta.saves = [(h, b) for h, b in meta.saves if not block_file(self.folder, h).is_file()]
        self._layer_kv = {}
        self._load_errors = set()

    def start_load_kv(self) -> None:
        shape, dtype = self._block_shape(), self.kv_caches[0][0].dtype
        for block_hash, block_id in self._meta.loads:
            data = read_block(block_file(self.folder, block_hash), block_hash, shape, dtype)
            if data is None:
                self._load_errors.add(block_id)
                continue
            for layer, (k, v) in enumerate(self.kv_caches):
                k[block_id].copy_(data[layer, 0])
                v[block_id].copy_(data[layer, 1])

    def save_kv_layer(self, layer_idx: int, k_cache, v_cache) -> None:
        if self._meta.saves:
            ids = torch.tensor([b for _, b in self._meta.saves], device=k_cache.device)
            self._layer_kv[layer_idx] = (k_cache[ids].cpu(), v_cache[ids].cpu())

    def wait_for_save(self) -> None:
        for i, (block_hash, _) in enumerate(self._meta.saves):
            data = torch.stack([torch.stack((self._layer_kv[layer][0][i],
                                             self._layer_kv[layer][1][i]))
                                for layer in range(len(self.kv_caches))])
            write_block(block_file(self.folder, block_hash), block_hash, data)
        self._count("saved_blocks", len(self._meta.saves))
        self._layer_kv = {}

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._load_errors)


__all__ = ["SharedStorageConnector", "SharedStorageMetadata", "read_block", "write_block",
           "block_file"]
