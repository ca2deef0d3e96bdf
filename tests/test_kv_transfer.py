"""KV connectors (minivllm/distributed/kv_transfer): configuration, the shared-storage
store between engines and processes, the offload tier. Every engine that loads KV
from outside must produce the tokens a plain engine produces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineArgs

BS = 4  # small blocks: many of them per prompt
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompts(n: int = 4, length: int = 37, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length + 3 * i)] for i in range(n)]


def storage(path, role: str = "kv_both") -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def run(model, items, params=GREEDY, **kwargs):
    kwargs.setdefault("num_kv_blocks", 256)  # (not the default 1 GiB cache: many engines here)
    llm = LLM(model, block_size=BS, cpu_kernels=False, **kwargs)
    try:
        outs = llm.generate(items, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], outs, llm
    finally:
        llm.shutdown()


def full_blocks(n_prompt: int) -> int:
    """Prompt tokens a connector can supply: full blocks, the last token excluded."""
    return (n_prompt - 1) // BS * BS


# -- configuration -----------------------------------------------------------
@pytest.mark.parametrize("config, words", [
    ({"kv_connector": "Nope"}, ["kv_connector", "'Nope'", "SharedStorageConnector"]),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "boss",
      "kv_connector_extra_config": {"shared_storage_path": "/tmp/x"}},
     ["kv_role", "'boss'", "kv_producer"]),
    ({"kv_connector": "SharedStorageConnector"}, ["shared_storage_path", "missing"]),
    ({"kv_connector": "SharedStorageConnector",
      "kv_connector_extra_config": {"shared_storage_path": "/tmp/x", "colour": 1}},
     ["colour", "shared_storage_path"]),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"cpu_bytes": 1 << 20}}, ["kv_role", "kv_both"]),
    ({"kv_connector": "SharedStorageConnector", "kv_rolls": "kv_both"},
     ["kv_rolls", "kv_role"]),
    ("{not json", ["kv_transfer_config", "JSON"]),
])
def test_bad_kv_transfer_config_is_refused_naming_the_field(config, words):
    with pytest.raises(ValueError) as e:
        EngineArgs(kv_transfer_config=config).create_engine_config()
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"kv_offloading_size": -1}, ["kv_offloading_size", "-1", "GiB"]),
    ({"kv_offloading_size": 1, "kv_offloading_backend": "lmcache"},
     ["kv_offloading_backend", "'lmcache'", "native"]),
    ({"kv_offloading_backend": "native"}, ["kv_offloading_backend", "kv_offloading_size"]),
    ({"kv_offloading_size": 1, "enable_prefix_caching": False},
     ["enable_prefix_caching", "OffloadingConnector"]),
])
def test_bad_offloading_arguments_are_refused(kwargs, words):
    with pytest.raises(ValueError) as e:
        EngineArgs(**kwargs).create_engine_config()
    for w in words:
        assert w in str(e.value)


def test_offloading_size_is_vllms_shorthand_for_the_offloading_connector(tiny_model):
    config = EngineArgs(tiny_model("llama"), kv_offloading_size=0.5,
                        kv_offloading_backend="native").create_engine_config()
    kt = config.kv_transfer
    assert (kt.kv_connector, kt.kv_role) == ("OffloadingConnector", "kv_both")
    assert kt.kv_connector_extra_config["cpu_bytes"] == 1 << 29


def test_serve_flag_takes_the_json_dict():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--kv-transfer-config", json.dumps(storage("/tmp/s")),
                            "--kv-offloading-size", "2"])
    args = EngineArgs.from_cli_args(ns)
    assert args.kv_transfer_config == storage("/tmp/s") and args.kv_offloading_size == 2.0


# -- shared storage ------------------------------------------------------------
def test_shared_storage_consumer_equals_a_single_engine(tiny_model, tmp_path):
    model, items = tiny_model("llama"), prompts()
    want, _, _ = run(model, items)
    produced, _, producer = run(model, items, kv_transfer_config=storage(tmp_path, "kv_producer"))
    assert produced == want
    files = list(tmp_path.glob("*.kvblock"))
    assert len(files) == len({h for p in items for h in _prompt_hashes(p)})
    got, outs, consumer = run(model, items, trace=True,
                              kv_transfer_config=storage(tmp_path, "kv_consumer"))
    assert got == want
    for p, o in zip(items, outs):
        assert o.num_cached_tokens == full_blocks(len(p))
    # The consumer computed only what did not come from the store.
    computed = sum(r.num_batched_tokens for r in consumer.trace.records)
    assert computed == sum(len(p) - full_blocks(len(p)) + GREEDY.max_tokens - 1
                           for p in items)


def _prompt_hashes(tokens):
    from minivllm.core.kv_cache_manager import hash_request_tokens

    return hash_request_tokens(tokens, BS)


def test_shared_storage_across_processes_with_chunked_prefill(tiny_model, tmp_path):
    """The producer is another process; the consumer prefills in small chunks."""
    model, items = tiny_model("llama"), prompts(3, 45, seed=1)
    code = (f"from minivllm import LLM, SamplingParams; "
            f"llm = LLM({str(model)!r}, block_size={BS}, cpu_kernels=False, num_kv_blocks=256, "
            f"kv_transfer_config={storage(tmp_path, 'kv_producer')!r}); "
            f"llm.generate({items!r}, SamplingParams(temperature=0, max_tokens=1), "
            f"use_tqdm=False); llm.shutdown()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    want, _, _ = run(model, items)
    got, outs, _ = run(model, items, max_num_batched_tokens=8,
                       kv_transfer_config=storage(tmp_path, "kv_consumer"))
    assert got == want
    assert [o.num_cached_tokens for o in outs] == [full_blocks(len(p)) for p in items]


def test_shared_storage_consumer_under_preemption(tiny_model, tmp_path):
    model, items = tiny_model("llama"), prompts(6, 30, seed=2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _, _ = run(model, items, params)
    run(model, items, SamplingParams(temperature=0, max_tokens=1),
        kv_transfer_config=storage(tmp_path, "kv_producer"))
    got, outs, _ = run(model, items, params, num_kv_blocks=40,
                       kv_transfer_config=storage(tmp_path, "kv_consumer"))
    assert got == want
    assert sum(o.metrics.num_preemptions for o in outs if o.metrics) > 0


def test_corrupt_or_missing_blocks_are_recomputed(tiny_model, tmp_path):
    model, items = tiny_model("llama"), prompts(2, 33, seed=3)
    want, _, _ = run(model, items)
    run(model, items, kv_transfer_config=storage(tmp_path, "kv_producer"))
    hashes = [_prompt_hashes(p) for p in items]
    from minivllm.distributed.kv_transfer.shared_storage import block_file

    # Prompt 0: its third block's file is damaged; prompt 1: its fifth is gone.
    damaged = block_file(tmp_path, hashes[0][2])
    raw = bytearray(damaged.read_bytes())
    raw[-200:-100] = bytes(100)
    damaged.write_bytes(bytes(raw))
    block_file(tmp_path, hashes[1][4]).unlink()
    got, outs, llm = run(model, items, kv_transfer_config=storage(tmp_path, "kv_consumer"))
    assert got == want
    # Prompt 0 started over after the bad load, finding only the two blocks before
    # the damaged one (loaded intact, kept in the prefix cache); prompt 1 stopped at the gap.
    assert [o.num_cached_tokens for o in outs] == [2 * BS, 4 * BS]
    assert llm.engine_core.kv_connector.stats["load_failures"] == 1


# -- offload tier ---------------------------------------------------------------
def _rounds(llm, items, rounds: int = 2):
    """Each prompt in turn, twice over: a history larger than the primary pool."""
    return [llm.generate([p], GREEDY, use_tqdm=False)[0]
            for _ in range(rounds) for p in items]


def test_offload_tier_brings_evicted_blocks_back(tiny_model):
    model, items = tiny_model("llama"), prompts(4, 40, seed=4)
    # 16 blocks of 4: one prompt and its answer fit, the four prompts do not.
    results = {}
    for tier in (None, 0.001):
        llm = LLM(model, block_size=BS, cpu_kernels=False, num_kv_blocks=16,
                  kv_offloading_size=tier)
        try:
            results[tier] = (_rounds(llm, items), llm.engine_core.kv_connector)
        finally:
            llm.shutdown()
    plain, _ = results[None]
    offloaded, connector = results[0.001]
    assert [o.outputs[0].token_ids for o in offloaded] == [o.outputs[0].token_ids
                                                           for o in plain]
    # Without the tier the second round finds nothing left; with it, every full
    # prompt block it had evicted comes back.
    assert all(o.num_cached_tokens == 0 for o in plain)
    second = offloaded[len(items):]
    assert [o.num_cached_tokens for o in second] == [full_blocks(len(p)) for p in items]
    assert connector.stats["hit_tokens"] == sum(full_blocks(len(p)) for p in items)
    assert connector.stats["stored_blocks"] > 0


# -- P2P: the decode engine pulls from the prefill engine ------------------------------
def p2p(role: str, **extra) -> dict:
    return {"kv_connector": "P2pConnector", "kv_role": role,
            "kv_connector_extra_config": extra}


def test_p2p_pull_equals_a_single_engine_and_frees_both_sides(tiny_model):
    model, items = tiny_model("llama"), prompts(3, 41, seed=5)
    want, _, _ = run(model, items)
    prefill = LLM(model, block_size=BS, cpu_kernels=False,
                  num_kv_blocks=256, kv_transfer_config=p2p("kv_producer"))
    decode = LLM(model, block_size=BS, cpu_kernels=False, trace=True, num_kv_blocks=256,
                 kv_transfer_config=p2p("kv_consumer"))
    try:
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                               extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        handed = [o.kv_transfer_params for o in prefill.generate(items, first, use_tqdm=False)]
        assert all(h["do_remote_prefill"] and h["remote_block_ids"] for h in handed)
        pool = prefill.engine_core.kv_cache_manager.block_pool
        assert pool.num_free_blocks < pool.num_blocks  # held for the pull
        # Offline nobody steps the idle prefill engine (a server's loop does, while
        # transfers are pending): one step hands the sends to its worker half.
        prefill.llm_engine.engine_core.step()
        outs = decode.generate(items, [GREEDY.clone(extra_args={"kv_transfer_params": h})
                                       for h in handed], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert [o.num_cached_tokens for o in outs] == [full_blocks(len(p)) for p in items]
        computed = sum(r.num_batched_tokens for r in decode.trace.records)
        assert computed == sum(len(p) - full_blocks(len(p)) + GREEDY.max_tokens - 1
                               for p in items)
        # Sent: the prefill side frees them on its next step.
        prefill.llm_engine.engine_core.step()
        assert pool.num_free_blocks == pool.num_blocks
        s = decode.engine_core.scheduler
        assert not (s.sending or s.waiting_for_remote)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_p2p_dead_prefill_engine_is_recomputed_within_the_timeout(tiny_model):
    import time

    model, items = tiny_model("llama"), prompts(2, 29, seed=6)
    want, _, _ = run(model, items)
    prefill = LLM(model, block_size=BS, cpu_kernels=False,
                  num_kv_blocks=256, kv_transfer_config=p2p("kv_producer"))
    first = SamplingParams(temperature=0, max_tokens=1,
                           extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    handed = [o.kv_transfer_params for o in prefill.generate(items, first, use_tqdm=False)]
    prefill.shutdown()  # gone before anyone pulls
    start = time.monotonic()
    got, outs, decode = run(model, items, [GREEDY.clone(extra_args={"kv_transfer_params": h})
                                           for h in handed],
                            kv_transfer_config=p2p("kv_consumer", timeout_s=1.0))
    assert time.monotonic() - start < 30
    assert got == want and [o.num_cached_tokens for o in outs] == [0, 0]
    runner = decode.llm_engine.engine_core.executor.runner
    assert runner.kv_connector.stats["failed_pulls"] == len(items)


def test_a_request_whose_kv_is_arriving_does_not_hold_the_others_back(tiny_model):
    """While one request waits for its blocks (the prefill side has not offered
    them yet), another request runs to its end; then the first one finishes too."""
    from minivllm.core.request import RequestStatus

    model, (slow, fast) = tiny_model("llama"), prompts(2, 33, seed=7)
    want, _, _ = run(model, [slow, fast])
    prefill = LLM(model, block_size=BS, cpu_kernels=False,
                  num_kv_blocks=256, kv_transfer_config=p2p("kv_producer"))
    decode = LLM(model, block_size=BS, cpu_kernels=False, num_kv_blocks=256,
                 kv_transfer_config=p2p("kv_consumer", timeout_s=120.0))
    try:
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                               extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        handed = prefill.generate([slow], first, use_tqdm=False)[0].kv_transfer_params
        engine, core = decode.llm_engine, decode.engine_core
        slow_id = engine.add_request(slow, GREEDY.clone(extra_args={"kv_transfer_params": handed}))
        fast_id = engine.add_request(fast, GREEDY)
        done = {}
        while fast_id not in done:
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert slow_id not in done
        assert core.scheduler.waiting_for_remote[slow_id].status == \
            RequestStatus.WAITING_FOR_REMOTE_KVS
        prefill.llm_engine.engine_core.step()  # the prefill side offers the blocks now
        while slow_id not in done:
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert [done[slow_id].outputs[0].token_ids, done[fast_id].outputs[0].token_ids] == want
        assert done[slow_id].num_cached_tokens == full_blocks(len(slow))
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_small_offload_tier_stays_bounded(tiny_model):
    """A tier of 12 blocks cannot hold every evicted block: LRU drops the oldest
    (round-robin prompts then miss), hits are fewer, tokens the same."""
    model, items = tiny_model("llama"), prompts(4, 40, seed=4)
    plain, _, _ = run(model, items)
    block_bytes = EngineArgs(model).create_engine_config().model.kv_bytes_per_token * BS
    llm = LLM(model, block_size=BS, cpu_kernels=False, num_kv_blocks=16,
              kv_offloading_size=12 * block_bytes / (1 << 30))
    try:
        connector = llm.engine_core.kv_connector
        assert connector.num_slots == 12
        outs = _rounds(llm, items)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs[:len(items)]] == plain
    assert [o.outputs[0].token_ids for o in outs[len(items):]] == plain
    assert connector.stats["hit_tokens"] < sum(full_blocks(len(p)) for p in items)
    assert len(connector.tier) == 12 < connector.stats["stored_blocks"]
