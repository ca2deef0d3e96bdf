"""``cache_salt`` (vLLM's tenant isolation): prefix-cache hits only under one salt.

A second tenant asking another tenant's prompt must find nothing cached, in the
device pool, the offload tier, beam search and hybrid models' groups alike
(tests/test_hybrid_features.py, on each kind of layer); its own
tenant must find the prefix. What a timing side channel measures is how many
tokens the engine computes for a request: the tests compare that count (from the
step trace) with a cold run's instead of timing anything. The salt changes no
token of the output.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import InvalidRequestError
from minivllm.core.kv_cache_manager import (KVCacheManager, hash_block_tokens,
                                              hash_request_tokens)
from minivllm.core.request import Request
from minivllm.routing import RoutingPolicy, prompt_block_hashes

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(10, 40))  # 30 tokens
HIT = (len(PROMPT) - 1) // BS * BS  # what a full hit reuses: the last token is always computed


def ask(llm, salt=None, prompt=PROMPT):
    item = {"prompt_token_ids": prompt}
    if salt is not None:
        item["cache_salt"] = salt
    return llm.generate(item, GREEDY, use_tqdm=False)[0]


def computed_tokens(llm, request_id: str) -> int:
    """Tokens the engine ran through the model for a request (the step trace)."""
    return sum(rec.scheduled[request_id][0] for rec in llm.trace.records
               if request_id in rec.scheduled)


def evict_all(llm, round_: int) -> None:
    """Two new prompts that need the whole (small) pool: every cached block is evicted."""
    for k in range(2):
        llm.generate({"prompt_token_ids": [100 + 2 * round_ + k] * 50}, GREEDY,
                     use_tqdm=False)


# -- offline, with and without the offload tier ---------------------------------------
@pytest.mark.parametrize("tier", [None, pytest.param(0.001, marks=pytest.mark.slow)],
                         ids=["pool", "offload-tier"])
def test_hits_stay_within_one_salt(tiny_model, tier):
    # With the tier the pool (16 blocks) cannot keep a prompt between requests: every
    # hit comes back from the tier, which must keep the tenants apart too.
    llm = LLM(tiny_model("llama"), block_size=BS, cpu_kernels=False, trace=True,
              num_kv_blocks=256 if tier is None else 16, kv_offloading_size=tier)
    try:
        outs = {}
        for i, salt in enumerate(["a", "b", None, "a", "b", None]):
            if tier is not None:
                evict_all(llm, i)
            outs[i] = ask(llm, salt)
        cold = outs[0]
        for i in (1, 2):  # another tenant (or none) on tenant a's prefix: nothing
            assert outs[i].num_cached_tokens == 0
            assert computed_tokens(llm, outs[i].request_id) == computed_tokens(
                llm, cold.request_id)
        for i in (3, 4, 5):  # each tenant's own second request: the whole prefix
            assert outs[i].num_cached_tokens == HIT
            assert computed_tokens(llm, outs[i].request_id) == computed_tokens(
                llm, cold.request_id) - HIT
        tokens = {tuple(o.outputs[0].token_ids) for o in outs.values()}
        assert len(tokens) == 1  # the salt changes no output
        if tier is not None:
            assert llm.engine_core.kv_connector.stats["hit_tokens"] == 3 * HIT
    finally:
        llm.shutdown()


def test_plain_engine_gives_the_salted_tokens(tiny_model):
    """The same tokens as an engine without prefix caching (the reference path)."""
    llm = LLM(tiny_model("llama"), block_size=BS, cpu_kernels=False,
              enable_prefix_caching=False, num_kv_blocks=64)
    try:
        want = ask(llm).outputs[0].token_ids
    finally:
        llm.shutdown()
    salted = LLM(tiny_model("llama"), block_size=BS, cpu_kernels=False, num_kv_blocks=64)
    try:
        assert [ask(salted, s).outputs[0].token_ids for s in ("x", "x", "y")] == [want] * 3
    finally:
        salted.shutdown()


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_bad_salt_names_the_field(tiny_model, salt):
    llm = LLM(tiny_model("llama"), block_size=BS, cpu_kernels=False, num_kv_blocks=16)
    try:
        with pytest.raises(InvalidRequestError, match="cache_salt") as e:
            llm.generate({"prompt_token_ids": PROMPT, "cache_salt": salt}, GREEDY,
                         use_tqdm=False)
        assert e.value.param == "cache_salt"
        with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
            llm.generate({"prompt_token_ids": PROMPT, "prompt": "x", "cache_salt": "a"},
                         GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


# -- the hash chain and what is named by it ----------------------------------------------
def test_salt_enters_the_first_block_only():
    """The salt is in the first block's extra keys; later blocks chain to it."""
    plain = hash_request_tokens(PROMPT, BS)
    a, b = hash_request_tokens(PROMPT, BS, cache_salt="a"), hash_request_tokens(
        PROMPT, BS, cache_salt="b")
    assert not set(a) & set(b) and not set(a) & set(plain)
    assert a[0] == hash_block_tokens(None, PROMPT[:BS], (("salt", "a"),))
    assert all(a[i] == hash_block_tokens(a[i - 1], PROMPT[i * BS:(i + 1) * BS])
               for i in range(1, len(a)))


def test_kv_events_carry_the_salted_hashes():
    kv = KVCacheManager(32, BS, enable_kv_cache_events=True)
    stored = {}
    for salt in ("a", "b"):
        req = Request(salt, PROMPT, SamplingParams(), max_tokens=4, cache_salt=salt)
        hits, n = kv.get_computed_blocks(req)
        assert n == 0  # the other tenant's blocks are no hit
        kv.allocate_slots(req, req.num_tokens, hits)
        events = kv.block_pool.take_events()
        stored[salt] = [h for e in events for h in e.block_hashes]
        assert stored[salt] == req.block_hashes == hash_request_tokens(PROMPT, BS,
                                                                     cache_salt=salt)
        assert events[0].parent_block_hash is None and events[0].token_ids == PROMPT[:28]
    assert not set(stored["a"]) & set(stored["b"])


def test_router_prefix_keys_include_the_salt():
    a, b = prompt_block_hashes(PROMPT, BS, "a"), prompt_block_hashes(PROMPT, BS, "b")
    assert a == hash_request_tokens(PROMPT[:-1], BS, cache_salt="a") and not set(a) & set(b)
    # prefix_aware: tenant a's prompt went to replica 1; tenant b's equal prompt is no
    # shared prefix there (the least loaded gets it), tenant a's next one follows it.
    policy = RoutingPolicy("prefix_aware", 2, balance_slack=4)
    assert policy.choose([1, 0], policy.prompt_hashes(PROMPT, BS, "a")) == 1
    assert policy.choose([0, 1], policy.prompt_hashes(PROMPT, BS, "b")) == 0
    assert policy.choose([0, 1], policy.prompt_hashes(PROMPT, BS, "a")) == 1


# -- beam search (hybrid groups: tests/test_hybrid_features.py) ----------------------
def test_beam_search_steps_inherit_the_salt(tiny_model):
    from minivllm import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=3)
    llm = LLM(tiny_model("llama"), block_size=BS, cpu_kernels=False, num_kv_blocks=128)
    try:
        plain = llm.beam_search([{"prompt_token_ids": PROMPT}], params)
        # A fresh engine: the salted search, then each tenant asks its prompt.
    finally:
        llm.shutdown()
    llm = LLM(tiny_model("llama"), block_size=BS, cpu_kernels=False, num_kv_blocks=128)
    try:
        salted = llm.beam_search([{"prompt_token_ids": PROMPT, "cache_salt": "a"}], params)
        assert [s.tokens for s in salted[0].sequences] == [s.tokens
                                                          for s in plain[0].sequences]
        assert ask(llm, None).num_cached_tokens == 0  # the search cached only under "a"
        assert ask(llm, "b").num_cached_tokens == 0
        assert ask(llm, "a").num_cached_tokens == HIT
    finally:
        llm.shutdown()


# -- the server: a top-level cache_salt on every generating endpoint ---------------------
ASK = [{"role": "user", "content": "Name three rivers of Europe and the seas they reach."}]


def _cached(server, endpoint: str, salt, tokens: int = 4) -> int:
    """One greedy request; the prompt tokens it found cached, as the endpoint reports."""
    body = {"model": "tiny", "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    if endpoint == "chat":
        body.update(messages=ASK, max_tokens=tokens)
    elif endpoint == "completions":
        body.update(prompt=ASK[0]["content"] * 2, max_tokens=tokens)
    elif endpoint == "responses":
        body.update(input=ASK, max_output_tokens=tokens)
    else:
        body.update(messages=ASK, max_tokens=tokens)
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
            "responses": "/v1/responses", "messages": "/v1/messages"}[endpoint]
    r = server.http.post(path, json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    if endpoint == "responses":
        return usage["input_tokens_details"]["cached_tokens"]
    if endpoint == "messages":
        return usage["cache_read_input_tokens"]
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
def test_server_endpoints_keep_tenants_apart(tmp_path, tiny_chat_model):
    from tests.helpers import ServerProcess

    server = ServerProcess(tmp_path, tiny_chat_model, "--inprocess", "--num-kv-blocks", "256",
                           "--block-size", str(BS), "--served-model-name", "tiny")
    try:
        for endpoint in ("chat", "completions", "responses", "messages"):
            _cached(server, endpoint, None)
            assert _cached(server, endpoint, None) > 0  # the unsalted prefix is cached...
            first_a = _cached(server, endpoint, f"{endpoint}-a")
            other = _cached(server, endpoint, f"{endpoint}-b")
            again_a = _cached(server, endpoint, f"{endpoint}-a")
            # ...and no hit under a salt; a tenant's own prefix is one.
            assert (first_a, other) == (0, 0) and again_a > 0, endpoint
        for salt in ("", 5):
            r = server.http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": ASK, "max_tokens": 2, "cache_salt": salt})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    finally:
        server.stop()


def test_shared_storage_block_files_are_named_per_salt(tiny_model, tmp_path):
    from minivllm.distributed.kv_transfer.shared_storage import block_file

    config = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}

    def engine():
        return LLM(tiny_model("llama"), block_size=BS, cpu_kernels=False, num_kv_blocks=64,
                   kv_transfer_config=config)

    producer = engine()
    try:
        want = ask(producer, "a").outputs[0].token_ids
    finally:
        producer.shutdown()
    salted = hash_request_tokens(PROMPT[:HIT], BS, cache_salt="a")
    assert all(block_file(tmp_path, h).is_file() for h in salted)
    assert not any(block_file(tmp_path, h).is_file()
                   for h in hash_request_tokens(PROMPT[:HIT], BS))
    consumer = engine()  # an empty pool: hits can only come from the files
    try:
        outs = [ask(consumer, s) for s in ("b", "a")]
        assert [o.num_cached_tokens for o in outs] == [0, HIT]
        assert [o.outputs[0].token_ids for o in outs] == [want, want]
    finally:
        consumer.shutdown()
