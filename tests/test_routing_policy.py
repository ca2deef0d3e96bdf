"""The routing policies (minivllm.routing), the code both the router and the simulator run."""

from __future__ import annotations

import pytest

from minivllm.core.kv_cache_manager import hash_request_tokens
from minivllm.routing import RoutingPolicy, prompt_block_hashes
from minivllm.sim.router import Router as SimRouter


def test_round_robin_skips_replicas_that_are_down():
    p = RoutingPolicy("round_robin", 3)
    assert [p.choose([0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert [p.choose([0, 0, 0], available=[True, False, True]) for _ in range(3)] == [2, 0, 2]
    with pytest.raises(ValueError, match="no replica is available"):
        p.choose([0, 0, 0], available=[False] * 3)


def test_cache_aware_policies_follow_the_longest_prefix_within_the_slack():
    tokens = list(range(100, 141))
    hashes = prompt_block_hashes(tokens, 8)
    assert hashes == hash_request_tokens(tokens[:-1], 8) and len(hashes) == 5
    caches = [set(hashes[:2]), set(hashes[:4]), set()]
    kv = RoutingPolicy("kv_aware", 3, balance_slack=2)
    assert kv.choose([0, 2, 0], hashes, caches) == 1  # most blocks cached
    assert kv.choose([0, 3, 0], hashes, caches) == 0  # 1 is too busy: next best
    assert kv.choose([1, 0, 0], [], caches) == 1  # no prefix: least loaded, lower index
    # prefix_aware remembers what it sent, not what is cached.
    pa = RoutingPolicy("prefix_aware", 3)
    first = pa.choose([0, 0, 0], hashes)
    assert first == 0 and pa.choose([0, 0, 0], hashes) == 0
    assert pa.choose([0, 0, 0], prompt_block_hashes(list(range(7, 48)), 8)) == 0
    assert pa.choose([1, 0, 0], hashes[:1]) == 0 and pa.choose([5, 0, 0], hashes) == 1


def test_the_simulators_router_is_the_shared_policy():
    """Same loads and caches in, same replica out, request by request."""
    class R:
        def __init__(self, load, cache):
            self.load, self.prefix_cache, self.block_size = load, cache, 4

    prompts = [[i % 3] * 9 + [i] for i in range(12)]
    for policy in ("round_robin", "least_loaded", "prefix_aware", "kv_aware"):
        sim, real = SimRouter(policy, 3), RoutingPolicy(policy, 3)
        caches = [set(), set(prompt_block_hashes(prompts[1], 4)), set()]
        for k, p in enumerate(prompts):
            loads = [k % 2, 0, k % 3]
            replicas = [R(loads[j], caches[j]) for j in range(3)]
            assert sim.choose(replicas, p) == real.choose(
                loads, prompt_block_hashes(p, 4), caches), (policy, k)


def test_bad_policy_arguments_name_themselves():
    with pytest.raises(ValueError, match="policy='fastest'"):
        RoutingPolicy("fastest", 2)
    with pytest.raises(ValueError, match="balance_slack=-1"):
        RoutingPolicy("kv_aware", 2, balance_slack=-1)
    with pytest.raises(ValueError, match="needs each replica's cached"):
        RoutingPolicy("kv_aware", 2).choose([0, 0], [1])
