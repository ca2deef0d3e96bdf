"""KV cache events: the block pool's prefix-cache changes, published over ZeroMQ.

A router in front of several engines wants to send a request where its prefix
is already cached. It cannot see into the engines, so each engine tells it,
as vLLM does, with three events:

* ``BlockStored``: full blocks entered the prefix cache. ``block_hashes`` are
  their hashes in chain order, ``parent_block_hash`` the hash of the block
  before the first one (None at the start of a sequence), ``token_ids`` the
  tokens of all of them (``block_size`` per block), ``lora_id`` / ``lora_name``
  the adapter whose K/V they hold (None: the base model).
* ``BlockRemoved``: blocks left the prefix cache (evicted for new contents).
* ``AllBlocksCleared``: the whole prefix cache was reset.

The engine core hands each step's events to the publisher as one
``KVEventBatch`` (a timestamp and the events in the order they happened).

On the wire (vLLM's layout, so vLLM's consumers read it): every batch is a
three-frame ZeroMQ message ``[topic, seq, payload]``. ``seq`` counts batches
from 0 as an 8-byte big-endian signed integer: a subscriber that sees a jump
missed batches and can ask the replay socket for them (send ``[b"", seq]``
from a DEALER socket; the replies are ``[b"", seq, payload]`` for every kept
batch from ``seq`` on, then ``[b"", -1, b""]``). ``payload`` is msgpack of
arrays, each event tagged by its name as the first element::

    batch          [ts, [event, ...]]
    BlockStored    ["BlockStored", [hash, ...], parent_hash | None, [token, ...],
                    block_size, lora_id | None, medium | None, lora_name | None]
    BlockRemoved   ["BlockRemoved", [hash, ...], medium | None]
    AllBlocksCleared ["AllBlocksCleared"]

A block hash is the 32-byte SHA-256 digest that names the block in the
engine (``hash_block_tokens``), sent as bytes: nothing is truncated, so a
subscriber's set equals the engine's exactly.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

HASH_BYTES = 32
END_OF_REPLAY = -1


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: Optional[str] = None


@dataclass
class AllBlocksCleared:
    pass


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass
class KVEventBatch:
    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)


# -- recording (the block pool's side) ---------------------------------------------
class KVEventRecorder:
    """The block pool's record of its prefix-cache changes, drained by the engine
    core every step. The pool holds one only when events are enabled."""

    def __init__(self) -> None:
        self.events: list[KVCacheEvent] = []

    def removed(self, block_hash: int) -> None:
        self.events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def stored(self, added: list[int], hashes: list[int], parent: Optional[int],
               token_ids: Sequence[int], block_size: int) -> None:
        """One BlockStored per run of consecutive new blocks (``added``: their indexes
        in ``hashes``); a run's parent is the block before it."""
        runs: list[list[int]] = []
        for i in added:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self.events.append(BlockStored(
                block_hashes=[hashes[i] for i in run],
                parent_block_hash=parent if first == 0 else hashes[first - 1],
                token_ids=list(token_ids[first * block_size:(last + 1) * block_size]),
                block_size=block_size))

    def take(self) -> list[KVCacheEvent]:
        """The events recorded since the last call."""
        events, self.events = self.events, []
        return events


# -- encoding -----------------------------------------------------------------------
def hash_to_bytes(block_hash: int) -> bytes:
    return block_hash.to_bytes(HASH_BYTES, "little")


def hash_from_wire(value) -> int:
    """A block hash as the engine names it; vLLM may also send plain integers."""
    return int.from_bytes(value, "little") if isinstance(value, bytes) else int(value)


def _event_to_wire(e: KVCacheEvent) -> list:
    if isinstance(e, BlockStored):
        parent = None if e.parent_block_hash is None else hash_to_bytes(e.parent_block_hash)
        return ["BlockStored", [hash_to_bytes(h) for h in e.block_hashes], parent,
                list(e.token_ids), e.block_size, e.lora_id, e.medium, e.lora_name]
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", [hash_to_bytes(h) for h in e.block_hashes], e.medium]
    if isinstance(e, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV cache event: {e!r}")


def _event_from_wire(raw: list) -> KVCacheEvent:
    tag, rest = raw[0], list(raw[1:])
    if tag == "BlockStored":
        rest += [None] * (7 - len(rest))  # trailing defaults may be left out
        hashes, parent, tokens, block_size, lora_id, medium, lora_name = rest[:7]
        return BlockStored([hash_from_wire(h) for h in hashes],
                           None if parent is None else hash_from_wire(parent),
                           list(tokens), block_size, lora_id, medium, lora_name)
    if tag == "BlockRemoved":
        return BlockRemoved([hash_from_wire(h) for h in rest[0]],
                            rest[1] if len(rest) > 1 else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV cache event tag {tag!r}: expected BlockStored, "
                     "BlockRemoved or AllBlocksCleared")


def encode_batch(batch: KVEventBatch) -> bytes:
    import msgspec

    return msgspec.msgpack.encode([batch.ts, [_event_to_wire(e) for e in batch.events]])


def decode_batch(payload: bytes) -> KVEventBatch:
    import msgspec

    raw = msgspec.msgpack.decode(payload)
    return KVEventBatch(raw[0], [_event_from_wire(e) for e in raw[1]])


def seq_to_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(data: bytes) -> int:
    return int.from_bytes(data, "big", signed=True)


def _binds(endpoint: str) -> bool:
    """A wildcard host or a local transport is ours to bind; anything else we connect to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# -- publishing ---------------------------------------------------------------------
class NullEventPublisher:
    """Events disabled: nothing is sent."""

    def publish(self, batch: KVEventBatch) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher:
    """Sends batches from a thread of its own: the engine's step never waits on a socket.

    ZeroMQ sockets belong to one thread, so that thread owns both the PUB
    socket and the replay ROUTER socket; ``publish`` only puts the batch on a
    queue. The last ``buffer_steps`` encoded batches are kept for replay.
    """

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, topic: str = "") -> None:
        import zmq

        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 500)  # the last batches get out at shutdown
        self._replay = None
        try:
            (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config endpoint {endpoint!r} / replay_endpoint "
                             f"{replay_endpoint!r}: cannot open ({e})") from None
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue = queue.Queue()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher",
                                        daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if batch.events:
            self._queue.put(batch)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encode_batch(batch)
            self._buffer.append((self._seq, payload))
            self._pub.send_multipart([self._topic, seq_to_bytes(self._seq), payload])
            self._seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        identity, start = frames[0], seq_from_bytes(frames[-1])
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([identity, b"", seq_to_bytes(seq), payload])
        self._replay.send_multipart([identity, b"", seq_to_bytes(END_OF_REPLAY), b""])

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)  # after every batch already queued
            self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._ctx.term()


def make_kv_event_publisher(config) -> "ZmqEventPublisher | NullEventPublisher":
    """The publisher a ``KVEventsConfig`` asks for (None: events are off)."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config.endpoint, config.replay_endpoint, config.buffer_steps,
                             config.hwm, config.topic)


def publish_kv_events(core) -> None:
    """``EngineCore.publish_kv_events``: hand the block pool's recorded cache changes to
    the core's publisher as one batch."""
    take_events = getattr(core.kv_cache_manager.block_pool, "take_events", None)
    if core.kv_event_publisher is None or take_events is None:  # (nothing recorded)
        return
    events = take_events()
    if events:
        core.kv_event_publisher.publish(KVEventBatch(time.time(), events))


# -- subscribing --------------------------------------------------------------------
class KVCacheIndex:
    """What a subscriber knows of one engine's prefix cache: the set of cached hashes."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.num_batches = 0

    def apply(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored):
                self.hashes.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.hashes.difference_update(e.block_hashes)
            else:
                self.hashes.clear()
        self.num_batches += 1

    def clear(self) -> None:
        self.hashes = set()


class KVEventSubscriber:
    """Follows one engine's events into a ``KVCacheIndex``, noticing what it missed.

    A jump in ``seq`` means lost batches: they are asked back from the replay
    socket; if that is not given, or no longer has them, the index is dropped
    (an unknown cache is better than a wrong one) and rebuilt from what comes.
    A ``seq`` that goes *back* means the engine restarted with an empty cache.
    """

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None,
                 topic: str = "") -> None:
        import zmq

        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.index = KVCacheIndex()
        self.last_seq = -1
        self.num_gaps = self.num_resyncs = 0
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint.replace("*", "127.0.0.1"))
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def poll(self, timeout_s: float = 0.1) -> int:
        """Apply every batch that arrives within ``timeout_s``; returns how many."""
        n = 0
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(left if n == 0 else 0):
                return n
            _, seq_b, payload = self._sub.recv_multipart()
            self._receive(seq_from_bytes(seq_b), payload)
            n += 1

    def _receive(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:  # the engine restarted: its cache is empty again
            self.index.clear()
            self.last_seq = -1
        if seq > self.last_seq + 1:  # missed some (or joined late)
            self.num_gaps += 1
            if not self._replay_from(self.last_seq + 1, seq):
                self.index.clear()
                self.num_resyncs += 1
        self.index.apply(decode_batch(payload))
        self.last_seq = seq

    def _replay_from(self, start: int, upto: int) -> bool:
        """Fetch batches [start, upto) from the replay socket; False if any is missing."""
        if self.replay_endpoint is None:
            return False
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint.replace("*", "127.0.0.1"))
        try:
            sock.send_multipart([b"", seq_to_bytes(start)])
            got = []
            while sock.poll(2000):
                _, seq_b, payload = sock.recv_multipart()
                seq = seq_from_bytes(seq_b)
                if seq == END_OF_REPLAY:
                    break
                if seq < upto:
                    got.append((seq, payload))
            if [s for s, _ in got] != list(range(start, upto)):
                return False
            for _, payload in got:
                self.index.apply(decode_batch(payload))
            return True
        finally:
            sock.close()

    def start(self) -> "KVEventSubscriber":
        """Follow in a background thread (the router's way)."""
        def loop():
            while not self._stop.is_set():
                self.poll(0.1)

        self._thread = threading.Thread(target=loop, name="kv-event-subscriber", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._sub.close()
        self._ctx.term()


__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch", "KVEventRecorder",
           "KVCacheEvent", "KVCacheIndex", "KVEventSubscriber", "ZmqEventPublisher",
           "NullEventPublisher", "make_kv_event_publisher", "publish_kv_events", "encode_batch",
           "decode_batch"]
