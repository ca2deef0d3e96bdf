"""KV events: a ZeroMQ subscriber rebuilds the engine's prefix cache exactly.

The engine's own map of cached hashes (``BlockPool.cached_block_hash_to_block``)
is the truth; a subscriber that applies the published BlockStored /
BlockRemoved / AllBlocksCleared must end with the same set, through evictions,
a reset, and having joined late (it asks the replay socket for what it missed).
"""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.core.kv_cache_manager import hash_block_tokens  # noqa: E402
from minivllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved,  # noqa: E402
                                            BlockStored, KVEventBatch, KVEventSubscriber,
                                            decode_batch, encode_batch)

BLOCK = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_hashes(llm) -> set[int]:
    return set(llm.engine_core.kv_cache_manager.block_pool.cached_block_hash_to_block)


def drain(sub: KVEventSubscriber, expected: set[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sub.index.hashes != expected and time.monotonic() < deadline:
        sub.poll(0.1)


def prompts(n: int, seed: int) -> list[dict]:
    """Prompts sharing starts (a common "system prompt", pairs of equal openings)."""
    system = list(range(10, 22))
    return [{"prompt_token_ids": system + [30 + (seed + i) % 5] * 6 + [100 + i, 101 + seed]}
            for i in range(n)]


def test_events_round_trip_in_vllms_layout():
    batch = KVEventBatch(1.5, [BlockStored([2**255 + 7, 3], None, list(range(8)), 4),
                               BlockRemoved([3]), AllBlocksCleared()])
    assert decode_batch(encode_batch(batch)) == batch


def check_stored_events(batches: list[KVEventBatch]) -> tuple[int, int]:
    """Every BlockStored names its blocks truly: parent + tokens re-hash to them."""
    stored = removed = 0
    for batch in batches:
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert e.block_size == BLOCK and len(e.token_ids) == BLOCK * len(e.block_hashes)
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    parent = hash_block_tokens(parent, e.token_ids[i * BLOCK:(i + 1) * BLOCK])
                    assert parent == h
                stored += len(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                removed += len(e.block_hashes)
    return stored, removed


def test_a_subscriber_rebuilds_the_cached_hash_set(tiny_model):
    import zmq

    pub, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
    # Few blocks: later prompts evict earlier ones (BlockRemoved).
    llm = LLM(tiny_model("llama"), block_size=BLOCK, num_kv_blocks=24, max_num_seqs=2,
              kv_events_config=config)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{pub}")
    ctx = zmq.Context()
    raw = ctx.socket(zmq.SUB)  # the wire itself: [topic, seq, payload]
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(f"tcp://127.0.0.1:{pub}")
    late = None
    try:
        time.sleep(0.3)  # the SUB connections are made before the first batch
        for round_ in range(4):
            llm.generate(prompts(4, round_), params, use_tqdm=False)
            drain(sub, engine_hashes(llm))
            assert sub.index.hashes == engine_hashes(llm), round_
            if round_ == 1:  # one that missed the first batches catches up by replay
                late = KVEventSubscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
                time.sleep(0.3)
        drain(late, engine_hashes(llm))
        assert late.index.hashes == engine_hashes(llm)
        assert late.num_gaps == 1 and late.num_resyncs == 0
        assert sub.num_gaps == 0 and sub.last_seq + 1 == sub.index.num_batches

        seqs, batches = [], []
        while raw.poll(200):
            topic, seq, payload = raw.recv_multipart()
            seqs.append(int.from_bytes(seq, "big", signed=True))
            batches.append(decode_batch(payload))
        assert seqs == list(range(len(seqs))) and seqs[-1] == sub.last_seq
        stored, removed = check_stored_events(batches)
        assert removed > 0 and stored - removed == len(engine_hashes(llm))

        assert llm.engine_core.reset_prefix_cache()
        drain(sub, set())
        assert sub.index.hashes == set() == engine_hashes(llm)
        assert isinstance(decode_batch(raw.recv_multipart()[2]).events[-1], AllBlocksCleared)
    finally:
        raw.close()
        ctx.term()
        for s in (sub, late):
            if s is not None:
                s.close()
        llm.shutdown()


def test_bad_kv_events_config_names_the_field(tiny_model):
    with pytest.raises(ValueError, match="kv_events_config.publisher"):
        LLM(tiny_model("llama"), kv_events_config={"enable_kv_cache_events": True,
                                                   "publisher": "kafka"})
    with pytest.raises(ValueError, match="kv_events_config\\['endpoit'\\]"):
        LLM(tiny_model("llama"), kv_events_config={"endpoit": "tcp://*:1"})
