"""Speculative decoding inside the engine: the configuration, the n-gram
proposer, and greedy runs that must equal the unspeculated run token for
token on tiny random models, through preemption, chunked prefill, stops,
max_tokens, abort and the prefix cache."""

from __future__ import annotations

import random

import pytest

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.config import SpeculativeConfig
from minivllm.core.kv_cache_manager import hash_request_tokens
from minivllm.core.spec_decode_stats import SpecDecodingStats
from minivllm.spec_decode.ngram_proposer import NgramProposer

# Drafts at every batch size: these tests are about the mechanics.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": None}


# -- configuration ----------------------------------------------------------------

@pytest.mark.parametrize("raw, match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": True}, r"num_speculative_tokens=True"),
    ({"method": "eagle", "num_speculative_tokens": 2}, r"method='eagle'.*ngram, draft_model"),
    ({"method": "ngram"}, r"num_speculative_tokens is missing"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, r"prompt_lookup_min=4.*<= prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     r"prompt_lookup_min=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_tokens": 2},
     r"unknown key\(s\) \['speculative_tokens'\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"model='x'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"model=None.*path"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     r"disable_by_batch_size=0"),
    ({"method": "ngram", "num_speculative_tokens": -1}, r"num_speculative_tokens=-1"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, r"num_speculative_tokens='3'"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, r"num_speculative_tokens=2.0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     r"prompt_lookup_max=0"),
    ({"method": None, "num_speculative_tokens": 2}, r"method=None.*ngram, draft_model"),
    ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, r"prompt_lookup_max=3.*only the \"ngram\" method"),
    ("ngram", r"speculative_config='ngram' is invalid: is not valid JSON"),
    ([3], r"speculative_config=\[3\] is invalid: must be a dict"),
])
def test_bad_speculative_config_names_the_field(raw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(speculative_config=raw).create_engine_config()


def test_lookup_bounds_fill_each_other_as_in_vllm():
    only_max = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_min": 3})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (3, 3)
    # Neither: the 2..5 that chapter 17 documents (vLLM's is 5..5, see SpeculativeConfig).
    neither = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (neither.prompt_lookup_min, neither.prompt_lookup_max) == (2, 5)
    from minivllm.config import DEFAULT_DISABLE_BY_BATCH_SIZE

    assert only_max.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 2, '
                                       '"disable_by_batch_size": null}'
                                       ).disable_by_batch_size is None
    # A model alone means a draft model, as in vLLM.
    assert SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 1}
                                       ).method == "draft_model"


# -- the n-gram proposer ----------------------------------------------------------

def reference_ngram(tokens, k, lo, hi):
    """Brute force over every n and start: the rule NgramProposer documents."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
        if starts:
            return tokens[starts[0] + n:starts[0] + n + k]
    return []


def test_ngram_proposer_matches_brute_force():
    rng = random.Random(0)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = lo + rng.randint(0, 3)
        got = NgramProposer(k, lo, hi).propose(tokens)
        assert got == reference_ngram(tokens, k, lo, hi), (tokens, k, lo, hi)
    quoted = [7, 1, 2, 3, 4, 5, 9, 9, 1, 2, 3]  # the earliest "1 2 3" wins
    assert NgramProposer(2, 1, 3).propose(quoted) == [4, 5]
    assert NgramProposer(5, 1, 3).propose(quoted, max_tokens=1) == [4]


def test_spec_decoding_stats_counts_positions():
    s = SpecDecodingStats()
    s.observe(3, 2)
    s.observe(3, 0)
    s.observe(2, 2)
    assert s.num_accepted_tokens_per_pos == [2, 2, 0]
    assert s.acceptance_rate == 4 / 8
    assert s.mean_accepted_length == 1 + 4 / 3
    with pytest.raises(ValueError, match="num_accepted_tokens=4"):
        s.observe(3, 4)


# -- greedy engine runs equal the unspeculated ones --------------------------------

def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Token prompts, most with repeated phrases (so the n-gram lookup hits)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(3, 256) for _ in range(rng.randint(2, 6))]
        body = phrase * rng.randint(1, 4) + [rng.randrange(3, 256) for _ in range(i % 5)]
        out.append(body + phrase[:rng.randint(1, len(phrase))])
    return out


def token_ids(llm, ps, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_blocks_held(llm):
    kv = llm.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_to_blocks


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def baseline(tiny):
    """The unspeculated greedy run of 12 prompts, 40 tokens each (ignore_eos)."""
    llm = LLM(tiny)
    ps = prompts(12)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = token_ids(llm, ps, params)
    llm.shutdown()
    return ps, params, out


@pytest.mark.parametrize("engine_args", [
    dict(),  # batched
    dict(max_num_seqs=1),  # each request alone
    dict(num_kv_blocks=24, block_size=4),  # preemption
    dict(max_num_batched_tokens=7, enable_prefix_caching=False),  # chunked, budget < 1 + k
], ids=["batched", "alone", "preempted", "chunked"])
def test_greedy_ngram_equals_unspeculated(tiny, baseline, engine_args):
    ps, params, expected = baseline
    if engine_args.get("max_num_seqs") == 1:
        ps, expected = ps[:3], expected[:3]  # one at a time: fewer, to stay quick
    llm = LLM(tiny, speculative_config=NGRAM, trace=True, **engine_args)
    got = token_ids(llm, ps, params)
    assert got == expected
    stats = llm.trace.spec_decoding_stats()
    assert stats.num_accepted_tokens > 0  # the drafts did take part
    records = list(llm.trace)
    if "num_kv_blocks" in engine_args:
        assert any(r.preempted for r in records)
    if "max_num_batched_tokens" in engine_args:
        assert max(r.num_batched_tokens for r in records) <= 7
    assert_no_blocks_held(llm)


def test_multi_token_steps_are_counted_in_trace_and_metrics(tiny, baseline):
    ps, params, expected = baseline
    llm = LLM(tiny, speculative_config=NGRAM, trace=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    trace_stats = llm.trace.spec_decoding_stats()
    total = SpecDecodingStats()
    for o in outs:
        total.add(o.metrics.spec_decoding)
    assert total == trace_stats == llm.engine_core.scheduler.make_stats().spec_decoding_stats
    # Fewer steps than tokens: each verification yields its accepted drafts + 1.
    steps = sum(1 for r in llm.trace if any(k == "decode" for _, k in r.scheduled.values()))
    assert steps < sum(len(t) for t in expected) - len(ps)


def test_max_tokens_and_stop_tokens_inside_an_accepted_run(tiny, baseline):
    ps, _, expected = baseline
    base, spec = LLM(tiny), LLM(tiny, speculative_config=NGRAM)
    # max_tokens of every size, up to a run's length: never exceeded.
    for max_tokens in (1, 2, 3, 5):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        got = token_ids(spec, ps, params)
        assert got == token_ids(base, ps, params) == [t[:max_tokens] for t in expected]
    # A stop token: the first output token that differs from the first one.
    for p, full in zip(ps, expected):
        stop = next((t for t in full[1:] if t != full[0]), None)
        if stop is None:
            continue
        params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop],
                                ignore_eos=True)
        a = spec.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
        b = base.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (
            b.token_ids, "stop", stop) and a.token_ids == full[:full.index(stop) + 1]
    assert_no_blocks_held(spec)


def test_prefix_cache_holds_only_accepted_tokens(tiny, baseline):
    ps, params, expected = baseline
    llm = LLM(tiny, speculative_config=NGRAM, block_size=4)
    assert token_ids(llm, ps, params) == expected
    pool = llm.engine_core.kv_cache_manager.block_pool
    accepted = set()
    for p, out in zip(ps, expected):
        accepted.update(hash_request_tokens(p + out, 4))
    assert pool.num_cached_blocks > 0
    assert set(pool.cached_block_hash_to_block) <= accepted
    # The cached blocks' K/V are right: a second run hits them and agrees.
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.num_cached_tokens for o in outs) > 0


def test_abort_in_the_middle_frees_everything(tiny, baseline):
    ps, params, expected = baseline
    llm = LLM(tiny, speculative_config=NGRAM)
    engine = llm.llm_engine
    ids = [engine.add_request(p, params) for p in ps]
    done = {}
    for step in range(200):
        if step == 3:
            engine.abort_request(ids[0])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert [done[i].outputs[0].token_ids for i in ids[1:]] == expected[1:]
    assert ids[0] not in done and not engine.has_unfinished_requests()
    assert_no_blocks_held(llm)


def test_disable_by_batch_size_turns_drafts_off(tiny, baseline):
    ps, params, expected = baseline
    cfg = dict(NGRAM, disable_by_batch_size=4)
    llm = LLM(tiny, speculative_config=cfg, trace=True)
    assert token_ids(llm, ps, params) == expected
    speculator = llm.engine_core.speculator
    assert speculator.num_disabled_steps > 0
    # One request at a time stays under the limit: drafts again.
    alone = LLM(tiny, speculative_config=cfg, trace=True, max_num_seqs=1)
    assert token_ids(alone, ps[:2], params) == expected[:2]
    assert alone.trace.spec_decoding_stats().num_drafts > 0


def test_logprobs_of_verified_tokens_equal_unspeculated(tiny, baseline):
    ps, _, _ = baseline
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    base, spec = LLM(tiny), LLM(tiny, speculative_config=NGRAM)
    a = base.generate([{"prompt_token_ids": p} for p in ps[:4]], params, use_tqdm=False)
    b = spec.generate([{"prompt_token_ids": p} for p in ps[:4]], params, use_tqdm=False)
    for x, y in zip(a, b):
        x, y = x.outputs[0], y.outputs[0]
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx.keys() == ly.keys()
            for t in lx:
                assert lx[t].logprob == pytest.approx(ly[t].logprob, abs=1e-4)
        assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-3)


def test_prometheus_counters_follow_the_scheduler_totals(tiny, baseline):
    from minivllm.metrics.prometheus import PrometheusStatLogger
    from tests.helpers import metric_samples

    ps, params, _ = baseline
    llm = LLM(tiny, speculative_config=NGRAM)
    logger = PrometheusStatLogger("tiny")
    scheduler = llm.engine_core.scheduler
    engine = llm.llm_engine
    for p in ps[:4]:
        engine.add_request(p, params)
    while engine.has_unfinished_requests():  # one snapshot per step, as the server sends
        engine.step()
        logger.record_scheduler_stats(scheduler.make_stats())
    stats = scheduler.spec_decoding_stats
    samples = metric_samples(logger.render().decode())
    assert samples[("minivllm:spec_decode_num_drafts_total", ())] == stats.num_drafts > 0
    assert samples[("minivllm:spec_decode_num_draft_tokens_total", ())] == \
        stats.num_draft_tokens
    assert samples[("minivllm:spec_decode_num_accepted_tokens_total", ())] == \
        stats.num_accepted_tokens
    per_pos = [samples[("minivllm:spec_decode_num_accepted_tokens_per_pos_total",
                        (("position", str(i)),))]
               for i in range(len(stats.num_accepted_tokens_per_pos))]
    assert per_pos == stats.num_accepted_tokens_per_pos


def test_the_served_metrics_carry_the_spec_decode_counters(tiny, baseline):
    """The server's path: engine-core batches -> AsyncLLM -> the logger /metrics renders."""
    import asyncio

    from minivllm.config import engine_args_from_kwargs
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.metrics.prometheus import PrometheusStatLogger
    from tests.helpers import metric_samples

    ps, params, expected = baseline
    logger = PrometheusStatLogger("tiny")
    engine = AsyncLLM.from_engine_args(
        engine_args_from_kwargs(tiny, dict(speculative_config=NGRAM)), in_process=True,
        stat_logger=logger)

    async def one(i):
        tokens = []
        async for out in engine.generate(ps[i], params, f"r{i}"):
            tokens = out.outputs[0].token_ids
        return tokens

    async def main():
        engine.start()
        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        assert asyncio.run(main()) == expected[:4]
        stats = engine.scheduler_stats.spec_decoding_stats
    finally:
        engine.shutdown()
    samples = metric_samples(logger.render().decode())
    p = "minivllm:spec_decode_"
    assert samples[(p + "num_drafts_total", ())] == stats.num_drafts > 0
    assert samples[(p + "num_draft_tokens_total", ())] == stats.num_draft_tokens
    assert samples[(p + "num_accepted_tokens_total", ())] == stats.num_accepted_tokens > 0
    assert [samples[(p + "num_accepted_tokens_per_pos_total", (("position", str(i)),))]
            for i in range(len(stats.num_accepted_tokens_per_pos))] == \
        stats.num_accepted_tokens_per_pos


def test_cli_takes_the_speculative_config_as_json():
    from minivllm.config import EngineArgs
    from minivllm.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["serve", "--speculative-config",
                                    '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert EngineArgs.from_cli_args(ns).speculative_config == {"method": "ngram",
                                                       "num_speculative_tokens": 2}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "{ngram"])
    ns = build_parser().parse_args(["bench", "throughput", "--speculative-config",
                                    '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert ns.speculative_config["num_speculative_tokens"] == 3


def test_ngram_with_tensor_parallelism_equals_one_process(tiny, baseline):
    ps, params, expected = baseline
    llm = LLM(tiny, tensor_parallel_size=2, speculative_config=NGRAM, trace=True)
    try:
        assert token_ids(llm, ps[:6], params) == expected[:6]
        assert llm.trace.spec_decoding_stats().num_accepted_tokens > 0
        assert_no_blocks_held(llm)
    finally:
        llm.shutdown()
