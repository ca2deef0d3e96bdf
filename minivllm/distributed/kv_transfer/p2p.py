"""``P2pConnector``: the decode engine pulls a prompt's KV blocks from the prefill
engine over ZeroMQ (TCP), request by request, as in vLLM's NIXL flow.

1. The prefill engine (``kv_producer``) gets a request whose
   ``kv_transfer_params`` say ``do_remote_decode``. It computes the prompt and
   one token; when the request finishes, the scheduler half keeps its blocks
   and returns ``kv_transfer_params``: where to pull from (host, port), the
   request id there and the block ids, and the hash of the last block.
2. The proxy hands those to the decode engine (``kv_consumer``). Its scheduler
   half offers the full prompt blocks as external tokens, *asynchronously*:
   the request gets blocks and waits aside (``WAITING_FOR_REMOTE_KVS``) while
   other requests keep stepping; its worker half pulls the blocks in a
   background thread and reports them received.
3. The prefill side's worker half serves the pull from its own thread and
   reports the request sent; its blocks are then freed. Blocks nobody pulls
   are freed after ``timeout_s``. A pull that gets no answer within
   ``timeout_s`` (the prefill engine died) is reported as a failed load: the
   decode engine computes the prompt itself.

No static peer configuration: each engine knows only its own address.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from minivllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata

DEFAULT_TIMEOUT_S = 10.0
_RETRY_S = 0.005


@dataclass
class P2pMetadata(KVConnectorMetadata):
    # Producer: request_id -> block ids to keep for a pull.
    sends: dict[str, list[int]] = field(default_factory=dict)
    # Consumer: request_id -> (host, port, remote request id, [(remote id, local id)]).
    loads: dict[str, tuple[str, int, str, list[tuple[int, int]]]] = field(default_factory=dict)


def _params_in(request) -> dict:
    return (request.sampling_params.extra_args or {}).get("kv_transfer_params") or {}


class P2pConnector(KVConnectorBase):
    def __init__(self, config, role, spec) -> None:
        super().__init__(config, role, spec)
        extra = config.kv_connector_extra_config
        self.host = extra.get("host", "127.0.0.1")
        self.timeout_s = float(extra.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.engine_id = config.engine_id or uuid.uuid4().hex[:12]
        self._next = P2pMetadata()
        self._matched: dict[str, tuple[int, int]] = {}
        self._done: set[str] = set()  # consumer: pulled once (or failed): never again
        # Worker half state.
        self._lock = threading.Lock()
        self._to_send: dict[str, tuple[list[int], float]] = {}  # rid -> (blocks, deadline)
        self._sent: set[str] = set()
        self._pulls: dict[str, tuple[Future, list[int]]] = {}
        self._load_errors: set[int] = set()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._server: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # -- scheduler half ------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        params, rid = _params_in(request), request.request_id
        if (not self.config.is_kv_consumer or not params.get("do_remote_prefill")
                or rid in self._done or request.sampling_params.prompt_logprobs is not None):
            return 0, False
        remote = params.get("remote_block_ids") or []
        n = min(len(remote), (request.num_tokens - 1) // self.block_size)
        # The last block's hash chains the whole prefix: same tokens on both sides.
        if n == 0 or params.get("remote_block_hash") != f"{request.block_hashes[n - 1]:064x}":
            return 0, False
        first = num_computed_tokens // self.block_size
        if first >= n:
            return 0, False
        self._matched[rid] = (first, n)
        return (n - first) * self.block_size, True

    def update_state_after_alloc(self, request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        first, n = self._matched.pop(request.request_id, (0, 0))
        if num_external_tokens == 0:
            return
        p = _params_in(request)
        pairs = list(zip(p["remote_block_ids"][first:n], block_ids[first:n]))
        self._next.loads[request.request_id] = (p["remote_host"], int(p["remote_port"]),
                                                p["remote_request_id"], pairs)
        self._done.add(request.request_id)
        self._count("pulled_tokens", num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> P2pMetadata:
        meta, self._next, self._matched = self._next, P2pMetadata(), {}
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, Optional[dict]]:
        self._done.discard(request.request_id)
        n = (request.num_prompt_tokens - 1) // self.block_size
        if (not self.config.is_kv_producer or not _params_in(request).get("do_remote_decode")
                or request.get_finish_reason() == "abort" or n == 0 or len(block_ids) < n):
            return False, None
        self._next.sends[request.request_id] = list(block_ids[:n])
        self._count("offered_tokens", n * self.block_size)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": self.engine_id, "remote_host": self.host,
                      "remote_port": self.config.kv_connector_extra_config["port"],
                      "remote_request_id": request.request_id,
                      "remote_block_ids": list(block_ids[:n]),
                      "remote_block_hash": f"{request.block_hashes[n - 1]:064x}"}

    # -- worker half ---------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        if self.config.is_kv_producer:
            self._start_server()
        else:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")

    def _start_server(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        extra = self.config.kv_connector_extra_config
        port = extra.get("port") or 0
        if port:
            sock.bind(f"tcp://{self.host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{self.host}")
        # The scheduler half, built next from the same config, advertises it.
        extra["port"] = port
        self._server = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                        name="kv-send")
        self._server.start()

    def _serve(self, sock) -> None:
        import zmq

        try:
            while not self._stop.is_set():
                if not sock.poll(100, zmq.POLLIN):
                    continue
                ident, _, body = sock.recv_multipart()
                ask = json.loads(body)
                header, payload = self._take(ask["request_id"], ask["block_ids"])
                sock.send_multipart([ident, b"", json.dumps(header).encode(), payload])
        finally:
            sock.close(0)

    def _take(self, rid: str, block_ids: list[int]) -> tuple[dict, bytes]:
        with self._lock:
            entry = self._to_send.get(rid)
            if entry is None:
                return {"status": "gone" if rid in self._sent else "not_ready"}, b""
            if not set(block_ids) <= set(entry[0]):
                return {"status": "bad_blocks"}, b""
            ids = torch.tensor(block_ids)
            data = torch.stack([torch.stack((k[ids], v[ids])) for k, v in self.kv_caches])
            del self._to_send[rid]
            self._sent.add(rid)
        data = data.cpu().contiguous()
        return ({"status": "ok", "shape": list(data.shape), "dtype": str(data.dtype)},
                data.view(torch.uint8).numpy().tobytes())

    def _pull(self, host: str, port: int, remote_rid: str, pairs) -> bool:
        import zmq

        deadline = time.monotonic() + self.timeout_s
        ctx = zmq.Context.instance()
        body = json.dumps({"request_id": remote_rid, "block_ids": [r for r, _ in pairs]})
        while time.monotonic() < deadline:
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(f"tcp://{host}:{port}")
                sock.send(body.encode())
                wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
                if not sock.poll(wait_ms, zmq.POLLIN):
                    return False  # no answer in time: the prefill engine is gone
                header, payload = sock.recv_multipart()
            finally:
                sock.close(0)
            header = json.loads(header)
            if header["status"] == "not_ready":  # its finish not yet bound there
                time.sleep(_RETRY_S)
                continue
            if header["status"] != "ok":
                return False
            k0 = self.kv_caches[0][0]
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(
                k0.dtype).view(header["shape"])
            local = torch.tensor([b for _, b in pairs], device=k0.device)
            for layer, (k, v) in enumerate(self.kv_caches):
                k.index_copy_(0, local, data[layer, 0].to(k.device))
                v.index_copy_(0, local, data[layer, 1].to(v.device))
            return True
        return False

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None:
            return
        now = time.monotonic()
        with self._lock:
            for rid, blocks in meta.sends.items():
                self._to_send[rid] = (blocks, now + self.timeout_s)
        for rid, (host, port, remote_rid, pairs) in meta.loads.items():
            future = self._pool.submit(self._pull, host, port, remote_rid, pairs)
            self._pulls[rid] = (future, [b for _, b in pairs])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        with self._lock:
            for rid, (_, deadline) in list(self._to_send.items()):
                if deadline < now:  # nobody came for them
                    del self._to_send[rid]
                    self._sent.add(rid)
                    self._count("expired_sends")
            sent, self._sent = self._sent, set()
        received = set()
        for rid, (future, local) in list(self._pulls.items()):
            if future.done():
                del self._pulls[rid]
                received.add(rid)
                if future.exception() is not None or not future.result():
                    self._load_errors.update(local)
                    self._count("failed_pulls")
        return sent, received

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=2)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["P2pConnector", "P2pMetadata"]
