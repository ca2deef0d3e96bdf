"""KV kept for agent sessions (retention_directives): the evictor's order on the
block pool against a plain list model of the rule, and through the engine a
session's next turn that finds its history cached where LRU had evicted it,
until the ttl passes; demotion to the offload tier; bad input."""

from __future__ import annotations

import math
import random

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import InvalidRequestError
from minivllm.core.block_pool import BlockPool
from minivllm.core.retained_blocks import block_retention, retain
from minivllm.inputs.retention import parse_retention_directives

BS = 4


class Clock:
    """The engine's clock, moved by hand."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


def pool_with_cached(n: int) -> tuple[BlockPool, Clock]:
    pool, clock = BlockPool(n), Clock()
    pool.clock = clock
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(blocks, [1000 + i for i in range(n)])
    return pool, clock


def assert_accounted(pool: BlockPool) -> None:
    """Every block is held, or in exactly one of the two free sets."""
    lru, kept = set(pool.free_block_queue), set(pool.retained or ())
    assert not lru & kept
    held = {b for b in pool.blocks if b.ref_cnt > 0}
    assert held | lru | kept == set(pool.blocks) and not held & (lru | kept)
    assert pool.num_free_blocks == len(lru) + len(kept)


def test_unretained_blocks_go_first_then_lowest_priority_oldest_first():
    pool, _ = pool_with_cached(6)
    b = pool.blocks
    retain(pool, [b[0], b[1], b[2]], [(50, None), (50, None), (10, None)])
    pool.free_blocks(b)  # freed in id order
    assert_accounted(pool)
    order = [pool.get_new_blocks(1)[0].block_id for _ in range(6)]
    assert order == [3, 4, 5, 2, 0, 1]
    assert pool.num_evicted == 6 and pool.num_cached_blocks == 0


def test_ttl_expired_blocks_age_as_if_freed_at_their_deadline():
    pool, clock = pool_with_cached(4)
    b = pool.blocks
    retain(pool, [b[0]], [(90, 5.0)])
    pool.free_blocks([b[0], b[1]])  # b0 kept until t=5, b1 ordinary
    clock.t = 4.0
    assert pool.get_new_blocks(1)[0] is b[1]  # still kept: the ordinary one goes
    pool.free_blocks([b[2]])  # freed at t=4, before b0's deadline
    clock.t = 6.0
    pool.free_blocks([b[3]])  # freed at t=6, after it... but seen after expiry runs
    # Expiry runs when blocks are taken: b0 joins the LRU tail then.
    assert [x.block_id for x in pool.get_new_blocks(3)] == [2, 3, 0]
    assert_accounted(pool)


def test_a_prefix_hit_takes_a_retained_block_back_and_clears_its_stamp():
    pool, _ = pool_with_cached(3)
    b = pool.blocks
    retain(pool, [b[0]], [(80, None)])
    pool.free_blocks(b)
    pool.touch([b[0]])
    assert b[0].retention_priority == 0 and b[0] not in pool.retained
    assert_accounted(pool)
    pool.free_blocks([b[0]])  # freed again without a directive: an ordinary block
    assert [x.block_id for x in pool.get_new_blocks(3)] == [1, 2, 0]


def test_only_cached_held_blocks_with_a_priority_are_kept():
    pool, _ = pool_with_cached(2)
    extra = BlockPool(3)
    fresh = extra.get_new_blocks(3)  # never cached: nothing to keep
    retain(extra, fresh, [(50, None)] * 3)
    assert all(x.retention_priority == 0 for x in fresh) and extra.retained is None
    retain(pool, pool.blocks, [(0, None), (30, 1.0)])
    assert [x.retention_priority for x in pool.blocks] == [0, 30]


def model_pop(free: list, now: float) -> dict:
    """The rule as a list: expired retained blocks become ordinary (in deadline
    order, after those already ordinary); the oldest ordinary block goes first, else
    the lowest priority, the oldest first among equals."""
    for e in sorted((e for e in free if e["prio"] and e["deadline"] <= now),
                    key=lambda e: (e["deadline"], e["seq"])):
        e["prio"], e["seq"] = 0, max(x["seq"] for x in free) + 1
    plain = [e for e in free if not e["prio"]]
    pick = (min(plain, key=lambda e: e["seq"]) if plain
            else min(free, key=lambda e: (e["prio"], e["seq"])))
    free.remove(pick)
    return pick


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_match_the_list_model(seed):
    rng = random.Random(seed)
    n = 12
    pool, clock = pool_with_cached(n)
    free: list[dict] = []
    seq = 0
    held = list(pool.blocks)
    for _ in range(300):
        clock.t += rng.choice([0.0, 0.5, 1.0])
        if held and rng.random() < 0.5:
            block = held.pop(rng.randrange(len(held)))
            if block.block_hash is None:  # recached under a fresh hash
                pool.cache_full_blocks([block], [rng.getrandbits(64)])
            prio, ttl = rng.choice([(0, None), (20, None), (20, 2.0), (60, 1.0), (60, None)])
            retain(pool, [block], [(prio, ttl)])
            pool.free_blocks([block])
            seq += 1
            free.append({"block": block, "prio": prio, "seq": seq,
                         "deadline": math.inf if ttl is None else clock.t + ttl})
        elif free:
            got = pool.get_new_blocks(1)[0]
            want = model_pop(free, clock.t)["block"]
            # (expired blocks take sequence numbers above every freed one: keep it so)
            seq = max([seq] + [e["seq"] for e in free])
            assert got is want
            held.append(got)
        assert_accounted(pool)


def test_directive_plan_per_block():
    d = parse_retention_directives([{"start": 0, "end": 8, "priority": 40, "ttl": 3},
                                    {"start": 6, "priority": 70}])
    assert block_retention(d, 4, BS) == [(40, 3.0), (70, None), (70, None), (70, None)]


@pytest.mark.parametrize("value, words", [
    ("keep", ["retention_directives", "list"]),
    ([{"priority": 101}], ["retention_directives[0].priority", "101", "[0, 100]"]),
    ([{"priority": 5, "ttl": 0}], ["retention_directives[0].ttl", "> 0"]),
    ([{}, {"start": 4, "end": 4}], ["retention_directives[1].end", "> start"]),
    ([{"start": -1}], ["retention_directives[0].start", ">= 0"]),
    ([{"keep": True}], ["retention_directives[0].keep", "unknown key"]),
    ([3], ["retention_directives[0]", "object"]),
])
def test_bad_directives_name_the_field(value, words):
    with pytest.raises(InvalidRequestError) as e:
        parse_retention_directives(value)
    assert e.value.param == "retention_directives"
    for w in words:
        assert w in str(e.value)


# -- through the engine ----------------------------------------------------------------
def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)
KEEP = [{"start": 0, "priority": 80, "ttl": 30.0}]


def session(llm: LLM, keep, clock: Clock, pause: float = 1.0):
    """Turn 1 of a session, two other requests while its tool runs, turn 2 (the
    history, a tool result, new text). Returns turn 2's output."""
    turn1 = tokens(30, 1)
    out1 = llm.generate([{"prompt_token_ids": turn1}],
                        SamplingParams(**GREEDY, retention_directives=keep),
                        use_tqdm=False)[0]
    clock.t += pause
    for seed in (2, 3):  # 8 blocks each: together they need every ordinary block
        llm.generate([{"prompt_token_ids": tokens(24, seed)}], SamplingParams(**GREEDY),
                     use_tqdm=False)
    turn2 = turn1 + list(out1.outputs[0].token_ids) + tokens(9, 4)
    return turn2, llm.generate([{"prompt_token_ids": turn2}],
                               SamplingParams(**GREEDY, retention_directives=keep),
                               use_tqdm=False)[0]


def run_session(model, keep, pause=1.0, **kwargs):
    # 16 blocks of 4: turn 1 and its answer take 9, each other request 8.
    llm = LLM(model, block_size=BS, cpu_kernels=False, num_kv_blocks=16, **kwargs)
    try:
        clock = Clock()
        llm.engine_core.kv_cache_manager.block_pool.clock = clock
        turn2, out = session(llm, keep, clock, pause)
        pool = llm.engine_core.kv_cache_manager.block_pool
        assert_accounted(pool)
        assert pool.num_free_blocks == pool.num_blocks  # no block leaked
        return turn2, out, llm.engine_core.kv_connector
    finally:
        llm.shutdown()


def cold(model, prompt) -> list[int]:
    llm = LLM(model, block_size=BS, cpu_kernels=False, num_kv_blocks=64,
              enable_prefix_caching=False)
    try:
        return llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**GREEDY),
                            use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_second_turn_hits_its_history_only_with_retention(tiny_model):
    model = tiny_model("llama")
    turn2, plain, _ = run_session(model, None)
    _, kept, _ = run_session(model, KEEP)
    _, expired, _ = run_session(model, KEEP, pause=31.0)  # the tool ran past the ttl
    assert plain.num_cached_tokens == 0  # LRU handed the history to the others
    assert expired.num_cached_tokens == 0
    # Kept: turn 1's prompt (30 tokens: 7 full blocks) and the answer's full blocks
    # but its last (the evictor's first retained pick: the tail was freed first).
    assert kept.num_cached_tokens == 8 * BS
    want = cold(model, turn2)
    assert plain.outputs[0].token_ids == want == kept.outputs[0].token_ids


def test_retained_blocks_pushed_out_are_demoted_to_the_offload_tier(tiny_model):
    """A pool too small even for the retained blocks evicts them too; with the offload
    tier on they were copied there first and the next turn loads them back."""
    model = tiny_model("llama")
    llm = LLM(model, block_size=BS, cpu_kernels=False, num_kv_blocks=16,
              kv_offloading_size=0.001)
    try:
        turn1 = tokens(30, 1)
        out1 = llm.generate([{"prompt_token_ids": turn1}],
                            SamplingParams(**GREEDY, retention_directives=KEEP),
                            use_tqdm=False)[0]
        # 58 + 6 tokens: 16 blocks, the whole pool, retained blocks included.
        llm.generate([{"prompt_token_ids": tokens(58, 5)}], SamplingParams(**GREEDY),
                     use_tqdm=False)
        pool = llm.engine_core.kv_cache_manager.block_pool
        assert len(pool.retained) == 0
        turn2 = turn1 + list(out1.outputs[0].token_ids) + tokens(9, 4)
        out2 = llm.generate([{"prompt_token_ids": turn2}], SamplingParams(**GREEDY),
                            use_tqdm=False)[0]
        connector = llm.engine_core.kv_connector
        assert connector.stats["hit_tokens"] >= 7 * BS
        assert out2.num_cached_tokens >= 7 * BS
        assert pool.num_free_blocks == pool.num_blocks
    finally:
        llm.shutdown()
    assert out2.outputs[0].token_ids == cold(model, turn2)


def test_bad_directives_are_refused_by_the_engine(tiny_model):
    llm = LLM(tiny_model("llama"), block_size=BS, cpu_kernels=False, num_kv_blocks=16)
    try:
        with pytest.raises(InvalidRequestError, match=r"retention_directives\[0\]\.ttl"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                         SamplingParams(retention_directives=[{"ttl": -1}]), use_tqdm=False)
    finally:
        llm.shutdown()


def test_server_requests_carry_the_directives():
    """Chat, Responses and Messages bodies reach SamplingParams with the field."""
    from minivllm.entrypoints.openai.protocol.chat import ChatCompletionRequest
    from minivllm.entrypoints.openai.protocol.messages import MessagesRequest
    from minivllm.entrypoints.openai.protocol.responses import ResponsesRequest
    from minivllm.entrypoints.openai.serving_messages import chat_request as from_messages
    from minivllm.entrypoints.openai.serving_responses import chat_request as from_responses
    from minivllm.sampling_params import RequestOutputKind

    msgs = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest.model_validate({"messages": msgs,
                                                 "retention_directives": KEEP})
    resp = from_responses(ResponsesRequest.model_validate(
        {"input": "hi", "retention_directives": KEEP}), msgs)
    mess = from_messages(MessagesRequest.model_validate(
        {"messages": msgs, "max_tokens": 4, "retention_directives": KEEP}))
    for req in (chat, resp, mess):
        params = req.to_sampling_params(RequestOutputKind.FINAL_ONLY)
        assert params.retention_directives == KEEP


def test_agent_sessions_bench_sends_turns_with_and_without_retention():
    """The bench's workload against a scripted server: each later turn is the history,
    the answer, a tool result and new text; only the "on" round's session turns carry
    the directives; both variants are reported."""
    import argparse

    from minivllm.lab.bench import serve
    from tests.test_bench_serve import StreamingServer

    srv = StreamingServer()
    try:
        parser = argparse.ArgumentParser()
        serve.add_cli_args(parser)
        args = parser.parse_args([
            "--base-url", srv.url, "--dataset-name", "agent-sessions", "--num-prompts", "6",
            "--agent-num-turns", "3", "--agent-context-len", "12", "--agent-tool-len", "4",
            "--agent-user-len", "3", "--agent-output-len", "2", "--agent-tool-time", "0.05",
            "--agent-background-rate", "40", "--agent-background-len", "7",
            "--agent-retention-ttl", "0.05", "--request-rate", "100"])
        result = serve.run(args)
        bodies = list(srv.requests)
    finally:
        srv.close()
    assert result.failed == 0
    assert [result.variants[v]["later_turns"] for v in ("off", "on")] == [4, 4]
    sessions = [b for b in bodies if b["messages"][0]["content"].startswith("Task")]
    background = [b for b in bodies if b not in sessions]
    assert len(sessions) == 12 and background
    assert all("retention_directives" not in b for b in background)
    kept = [b for b in sessions if "retention_directives" in b]
    assert len(kept) == 6 and kept[0]["retention_directives"] == [
        {"start": 0, "priority": 50, "ttl": 0.05}]
    for b in sessions:
        roles = [m["role"] for m in b["messages"]]
        turns = (len(roles) - 1) // 3
        assert roles == ["user"] + ["assistant", "tool", "user"] * turns
