"""The V1 scheduler driven by a stand-in model that really uses the paged cache.

No model exists at this layer, so ``PagedTokenModel`` plays one. Its "KV
cache" stores, per physical slot, the token id written there; to predict the
next token it reads the whole context back *through the block table* and
applies a fixed, order-sensitive function. A wrong block table, a block
shared when it should not be, a prefix-cache hit on other tokens or a lost
token after preemption all change its answers, so each test compares
against the same function applied to the plain token list (``chain``) or
against the same request run alone.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.outputs import EngineCoreOutput
from minivllm.core.request import Request, RequestStatus
from minivllm.core.scheduler import Scheduler
from minivllm.core.sched_output import SchedulerOutput
from minivllm.sampling_params import SamplingParams

VOCAB = 64
LOGPROB = -0.25  # what the stand-in model reports for every chosen token


def next_token(context: list[int]) -> int:
    acc = 0
    for t in context:
        acc = (acc * 31 + t + 1) % 1_000_003
    return acc % VOCAB


def chain(prompt: list[int], n: int) -> list[int]:
    """n tokens of greedy generation on the plain token list (no cache at all)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class PagedTokenModel:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.contexts: dict[str, list[int | None]] = {}  # last step's reads

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> dict:
        # Like every attention layer: store all new K/V of the step, then read.
        for req in out.scheduled_requests:
            rid = req.request_id
            start = out.num_computed_tokens[rid]
            for pos in range(start, start + out.num_scheduled_tokens[rid]):
                self.slots[self._slot(out.block_ids[rid], pos)] = req.all_token_ids[pos]
        self.contexts = {}
        sampled = {}
        for req in out.scheduled_requests:
            rid = req.request_id
            end = out.num_computed_tokens[rid] + out.num_scheduled_tokens[rid]
            if end < req.num_tokens:
                continue  # partial prefill: no logits to sample from
            context = [self.slots[self._slot(out.block_ids[rid], p)] for p in range(end)]
            self.contexts[rid] = context
            logprobs = None
            token = next_token(context)
            if req.sampling_params.logprobs is not None:
                logprobs = (LOGPROB, {token: LOGPROB})
            sampled[rid] = (token, logprobs)
        return sampled


@dataclass
class Run:
    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=lambda: defaultdict(list))
    steps: list[SchedulerOutput] = field(default_factory=list)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def finish_reason(self, rid: str):
        return self.outputs[rid][-1].finish_reason


def step(sched: Scheduler, model: PagedTokenModel, run: Run) -> SchedulerOutput:
    out = sched.schedule()
    check_step(sched, out)
    sampled = model.execute(out)
    for rid, context in model.contexts.items():
        req = next(r for r in out.scheduled_requests if r.request_id == rid)
        assert context == req.all_token_ids[:len(context)], f"{rid} read wrong K/V"
    for o in sched.update_from_output(out, sampled):
        run.outputs[o.request_id].append(o)
    run.steps.append(out)
    check_holders(sched)
    return out


def drive(sched: Scheduler, model: PagedTokenModel, run: Run | None = None,
          max_steps: int = 5000) -> Run:
    run = run or Run()
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return run
        step(sched, model, run)
    raise AssertionError("requests did not finish")


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Limits and bookkeeping right after schedule()."""
    kv = sched.kv_cache_manager
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    assert out.num_seqs <= sched.config.max_num_seqs
    assert out.request_ids() == list(out.num_scheduled_tokens)
    for req in out.scheduled_requests:
        rid = req.request_id
        n, done = out.num_scheduled_tokens[rid], out.num_computed_tokens[rid]
        assert n >= 1 and done + n <= req.num_tokens
        if sched.config.long_prefill_token_threshold:
            assert n <= sched.config.long_prefill_token_threshold
        assert req.status == RequestStatus.RUNNING and done == req.num_computed_tokens
        assert out.block_ids[rid] == kv.get_block_ids(rid)
        assert len(out.block_ids[rid]) == kv.num_blocks_needed(done + n)
    for req in sched.running:
        if req.request_id not in out.num_scheduled_tokens:
            blocks = kv.get_block_ids(req.request_id)
            assert len(blocks) == kv.num_blocks_needed(req.num_computed_tokens)
    check_holders(sched, out)


def check_holders(sched: Scheduler, out: SchedulerOutput | None = None) -> None:
    """Ref counts equal holders; only cached full prefix blocks are shared."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    assert set(kv.req_to_blocks) == {r.request_id for r in sched.running}
    holders: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for rid, blocks in kv.req_to_blocks.items():
        assert len({b.block_id for b in blocks}) == len(blocks)
        for i, block in enumerate(blocks):
            holders[block.block_id].append((rid, i))
    for block in pool.blocks:
        held = holders[block.block_id]
        assert block.ref_cnt == len(held)
        assert (block in pool.free_block_queue) == (block.ref_cnt == 0)
        if len(held) > 1:
            assert block.block_hash is not None
            for rid, i in held:
                req = sched.requests[rid]
                assert req.block_hashes[i] == block.block_hash
                filled = req.num_computed_tokens
                if out is not None:
                    filled += out.num_scheduled_tokens.get(rid, 0)
                assert (i + 1) * kv.block_size <= filled
    assert len(pool.free_block_queue) == pool.num_free_blocks
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert req.num_computed_tokens == 0


def make_request(rid: str, prompt: list[int], max_tokens: int = 8,
                 eos: tuple[int, ...] = (), **params) -> Request:
    return Request(rid, prompt, SamplingParams(**params), max_tokens=max_tokens,
                   eos_token_ids=frozenset(eos))


def clone(req: Request, rid: str | None = None) -> Request:
    return Request(rid or req.request_id, req.prompt_token_ids, req.sampling_params,
                   req.max_tokens, req.eos_token_ids)


@pytest.fixture
def make():
    """Build schedulers; afterwards every one must be idle with all blocks free."""
    made: list[Scheduler] = []

    def build(num_blocks=64, block_size=4, budget=32, max_num_seqs=8, max_model_len=128,
              caching=True, **config):
        kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
        sched = Scheduler(SchedulerConfig(budget, max_num_seqs, max_model_len, **config), kv)
        made.append(sched)
        return sched, PagedTokenModel(num_blocks, block_size)

    yield build
    for sched in made:
        assert not sched.has_unfinished_requests()
        kv = sched.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def run_alone(req: Request, max_model_len: int, block_size: int = 4) -> tuple[list[int], str]:
    """The unbatched reference: one request, ample blocks and budget, no prefix cache."""
    num_blocks = -(-(max_model_len + 1) // block_size)
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_model_len, 1, max_model_len), kv)
    sched.add_request(clone(req))
    run = drive(sched, PagedTokenModel(num_blocks, block_size))
    assert kv.num_free_blocks == num_blocks
    return run.tokens(req.request_id), run.finish_reason(req.request_id)


# -- basics --------------------------------------------------------------------------

def test_single_request_generates_the_reference_tokens(make):
    sched, model = make()
    prompt = list(range(3, 13))
    sched.add_request(make_request("r", prompt, max_tokens=6))
    run = drive(sched, model)
    assert run.tokens("r") == chain(prompt, 6)
    assert [len(o.new_token_ids) for o in run.outputs["r"]] == [1] * 6
    assert run.finish_reason("r") == "length"
    assert run.steps[0].num_scheduled_tokens == {"r": 10}
    assert all(s.num_scheduled_tokens == {"r": 1} for s in run.steps[1:])


def test_budget_and_max_num_seqs_hold_every_step(make):
    rng = random.Random(0)
    sched, model = make(budget=24, max_num_seqs=3)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randint(5, 40))]
               for i in range(10)}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=5))
    run = drive(sched, model)  # step() checks the limits after every schedule()
    assert max(s.num_seqs for s in run.steps) == 3
    assert max(s.total_num_scheduled_tokens for s in run.steps) == 24
    for rid, prompt in prompts.items():
        assert run.tokens(rid) == chain(prompt, 5)


def test_chunked_prefill_splits_a_long_prompt_and_shares_steps_with_decodes(make):
    budget = 16
    sched, model = make(budget=budget)
    short, long_ = list(range(1, 7)), [(7 * i) % VOCAB for i in range(50)]
    sched.add_request(make_request("short", short, max_tokens=10))
    sched.add_request(make_request("long", long_, max_tokens=3))
    run = drive(sched, model)

    chunks, mixed = [], 0
    for s in run.steps:
        n = s.num_scheduled_tokens.get("long")
        if n is None or s.num_computed_tokens["long"] >= len(long_):
            continue
        chunks.append(n)
        used_before = sum(v for k, v in s.num_scheduled_tokens.items() if k != "long")
        assert n == min(len(long_) - s.num_computed_tokens["long"], budget - used_before)
        if s.num_scheduled_tokens.get("short") == 1:
            mixed += 1
    assert sum(chunks) == len(long_) and len(chunks) > 1
    assert mixed >= 1
    # The long request produced nothing until its last chunk.
    assert len(run.outputs["long"]) == 3
    assert run.tokens("short") == chain(short, 10)
    assert run.tokens("long") == chain(long_, 3)


def test_without_chunking_a_prompt_waits_for_a_step_where_it_fits(make):
    sched, model = make(budget=32, max_model_len=32, enable_chunked_prefill=False)
    a, b = list(range(20)), list(range(30, 50))
    sched.add_request(make_request("a", a, max_tokens=4))
    sched.add_request(make_request("b", b, max_tokens=4))
    run = drive(sched, model)
    assert run.steps[0].num_scheduled_tokens == {"a": 20}
    assert run.steps[1].num_scheduled_tokens == {"a": 1, "b": 20}
    assert run.tokens("a") == chain(a, 4) and run.tokens("b") == chain(b, 4)


def test_long_prefill_token_threshold_caps_each_chunk(make):
    sched, model = make(budget=64, long_prefill_token_threshold=8)
    a, b = list(range(30)), list(range(40, 52))
    sched.add_request(make_request("a", a, max_tokens=2))
    sched.add_request(make_request("b", b, max_tokens=2))
    run = drive(sched, model)
    prefill = [s.num_scheduled_tokens["a"] for s in run.steps
               if "a" in s.num_scheduled_tokens and s.num_computed_tokens["a"] < len(a)]
    assert prefill == [8, 8, 8, 6]
    assert run.steps[0].num_scheduled_tokens == {"a": 8, "b": 8}
    assert run.tokens("a") == chain(a, 2) and run.tokens("b") == chain(b, 2)


# -- preemption ------------------------------------------------------------------------

@pytest.mark.parametrize("caching", [True, False])
def test_preemption_frees_the_newest_and_it_later_finishes_with_all_tokens(make, caching):
    sched, model = make(num_blocks=10, block_size=4, budget=64, max_num_seqs=3,
                        caching=caching)
    # r3 waits behind the others (max_num_seqs) when the first preemption comes.
    prompts = {f"r{i}": [(i * 13 + j * 5) % VOCAB for j in range(8)] for i in range(4)}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=12))
    run = Run()
    seen_preemption, waited_behind = False, 0
    while sched.has_unfinished_requests():
        running_before = [r.request_id for r in sched.running]
        out = step(sched, model, run)
        if out.preempted_req_ids:
            seen_preemption = True
            # Victims are the most recently admitted, newest first.
            k = len(out.preempted_req_ids)
            assert out.preempted_req_ids == running_before[::-1][:k]
            assert out.new_req_ids == []  # no admissions in a step that preempted
            front = [r.request_id for r in list(sched.waiting)[:k]]
            assert front == out.preempted_req_ids[::-1]
            waited_behind += len(sched.waiting) > k
            for rid in out.preempted_req_ids:
                req = sched.requests[rid]
                assert req.status == RequestStatus.PREEMPTED
                assert req.num_computed_tokens == 0 and rid not in out.num_scheduled_tokens
    assert seen_preemption and waited_behind and sched.num_preemptions == sum(
        len(s.preempted_req_ids) for s in run.steps)
    victims = {rid for s in run.steps for rid in s.preempted_req_ids}
    for rid, prompt in prompts.items():
        assert run.tokens(rid) == chain(prompt, 12)
        assert run.finish_reason(rid) == "length"
        assert (run.outputs[rid][-1].num_preemptions > 0) == (rid in victims)
        assert run.outputs[rid][-1].num_cached_tokens == 0  # set at first admission only


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_request_rejoins_later_and_keeps_its_first_num_cached_tokens(
        make, caching):
    sched, model = make(num_blocks=5, block_size=4, budget=16, max_model_len=64,
                        long_prefill_token_threshold=4, caching=caching)
    small, big = [1, 2, 3], list(range(10, 26))
    sched.add_request(make_request("small", small, max_tokens=10))
    sched.add_request(make_request("big", big, max_tokens=5))
    run = drive(sched, model)
    preempting = [s for s in run.steps if s.preempted_req_ids]
    assert preempting and all(s.preempted_req_ids == ["big"] for s in preempting)
    # A step that had to preempt admits nobody, not even the victim.
    assert all(s.new_req_ids == [] for s in preempting)
    rejoined = [s for s in run.steps[1:] if "big" in s.new_req_ids]
    assert len(rejoined) == len(preempting)
    if caching:  # the recompute starts from the victim's surviving cached blocks
        assert rejoined[-1].num_computed_tokens["big"] > 0
        assert rejoined[-1].num_prefix_cache_hit_tokens > 0
    assert run.outputs["big"][-1].num_cached_tokens == 0  # first admission had none
    assert run.tokens("small") == chain(small, 10) and run.tokens("big") == chain(big, 5)


def test_a_request_that_is_itself_the_newest_preempts_itself(make):
    sched, model = make(num_blocks=4, block_size=4, budget=64, max_model_len=16)
    a, b = list(range(6)), list(range(20, 28))  # 2 blocks each: the cache is full
    sched.add_request(make_request("a", a, max_tokens=6))
    sched.add_request(make_request("b", b, max_tokens=6))
    run = Run()
    step(sched, model, run)
    out = step(sched, model, run)  # b's first decode needs a 3rd block
    assert out.preempted_req_ids == ["b"] and out.request_ids() == ["a"]
    drive(sched, model, run)
    assert run.tokens("a") == chain(a, 6) and run.tokens("b") == chain(b, 6)


# -- prefix caching ----------------------------------------------------------------------

def test_prefix_hit_skips_cached_tokens_and_keeps_the_outputs(make):
    sched, model = make(block_size=4)
    system = [(3 * i + 1) % VOCAB for i in range(16)]
    first, second = system + [1, 2, 3, 4, 5, 6], system + [9, 8, 7, 6, 5]
    sched.add_request(make_request("first", first, max_tokens=4))
    run = drive(sched, model)
    sched.add_request(make_request("second", second, max_tokens=4))
    drive(sched, model, run)
    out = run.steps[-4]  # second's prefill step
    assert out.new_req_ids == ["second"]
    assert out.num_computed_tokens["second"] == 16
    assert out.num_scheduled_tokens["second"] == len(second) - 16
    assert out.num_prefix_cache_hit_tokens == 16
    assert run.outputs["first"][-1].num_cached_tokens == 0
    assert run.outputs["second"][-1].num_cached_tokens == 16
    assert run.tokens("first") == chain(first, 4)
    assert run.tokens("second") == chain(second, 4)
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (
        len(first) + len(second), 16)


def test_same_step_hit_reads_blocks_written_in_that_step(make):
    sched, model = make(block_size=4, budget=64)
    prompt = [(5 * i + 2) % VOCAB for i in range(18)]
    sched.add_request(make_request("a", prompt, max_tokens=3))
    sched.add_request(make_request("b", prompt, max_tokens=3))
    run = Run()
    out = step(sched, model, run)
    assert out.num_scheduled_tokens == {"a": 18, "b": 2}
    assert out.block_ids["b"][:4] == out.block_ids["a"][:4]
    drive(sched, model, run)
    assert run.tokens("a") == run.tokens("b") == chain(prompt, 3)


def test_prefix_caching_changes_no_output(make):
    """Cached vs uncached on a workload with shared prefixes: identical tokens."""
    rng = random.Random(1)
    system = [rng.randrange(VOCAB) for _ in range(12)]
    prompts = {f"r{i}": system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
               for i in range(8)}
    results = {}
    for caching in (True, False):
        sched, model = make(num_blocks=24, budget=16, max_num_seqs=4, caching=caching)
        for rid, prompt in prompts.items():
            sched.add_request(make_request(rid, prompt, max_tokens=7))
        run = drive(sched, model)
        results[caching] = {rid: run.tokens(rid) for rid in prompts}
        hits = sum(s.num_prefix_cache_hit_tokens for s in run.steps)
        assert (hits > 0) == caching
    assert results[True] == results[False]
    assert results[False] == {rid: chain(p, 7) for rid, p in prompts.items()}


# -- stopping --------------------------------------------------------------------------

def expected_stop(tokens: list[int], stops: set[int], min_tokens: int, max_tokens: int):
    """The stop rule from the spec, applied to the reference chain."""
    for i, t in enumerate(tokens[:max_tokens]):
        if i + 1 >= min_tokens and t in stops:
            return tokens[:i + 1], "stop"
    return tokens[:max_tokens], "length"


PROMPT = [11, 22, 33, 44, 55]
REF = chain(PROMPT, 20)


@pytest.mark.parametrize("case", ["eos", "ignore_eos", "stop_token", "min_tokens"])
def test_token_level_stop_conditions(make, case):
    eos, params, stops, min_tokens = (), {}, set(), 0
    if case in ("eos", "ignore_eos", "min_tokens"):
        eos = (REF[3],)
        stops = set() if case == "ignore_eos" else set(eos)
        params = {"ignore_eos": case == "ignore_eos"}
        if case == "min_tokens":
            min_tokens = REF.index(REF[3]) + 2
            params["min_tokens"] = min_tokens
    else:
        params, stops = {"stop_token_ids": [REF[2]]}, {REF[2]}
    sched, model = make()
    sched.add_request(make_request("r", PROMPT, max_tokens=20, eos=eos, **params))
    run = drive(sched, model)
    tokens, reason = expected_stop(REF, stops, min_tokens, 20)
    assert run.tokens("r") == tokens and run.finish_reason("r") == reason
    last = run.outputs["r"][-1]
    assert last.stop_reason == (REF[2] if case == "stop_token" else None)
    if case == "eos":
        assert reason == "stop" and len(tokens) == REF.index(REF[3]) + 1


def test_max_model_len_caps_the_length(make):
    sched, model = make(max_model_len=14)
    sched.add_request(make_request("r", list(range(10)), max_tokens=100))
    run = drive(sched, model)
    assert run.tokens("r") == chain(list(range(10)), 4)
    assert run.finish_reason("r") == "length"


def test_logprobs_are_recorded_per_token(make):
    sched, model = make()
    req = make_request("r", PROMPT, max_tokens=5, logprobs=1)
    sched.add_request(req)
    run = drive(sched, model)
    assert all(o.new_logprobs == [(LOGPROB, {t: LOGPROB})]
               for o in run.outputs["r"] for t in o.new_token_ids)
    assert len(req.logprobs) == 5
    assert req.cumulative_logprob == pytest.approx(5 * LOGPROB)


# -- aborts -------------------------------------------------------------------------------

def test_abort_waiting_and_running_requests(make):
    sched, model = make(max_num_seqs=1)
    a = make_request("a", list(range(9)), max_tokens=50)
    b = make_request("b", list(range(5)), max_tokens=50)
    sched.add_request(a), sched.add_request(b)
    run = Run()
    step(sched, model, run)
    assert [r.request_id for r in sched.waiting] == ["b"]
    sched.abort_requests(["b", "no-such-request"])
    assert b.status == RequestStatus.FINISHED_ABORTED and b.get_finish_reason() == "abort"
    assert sched.num_waiting == 0
    out = step(sched, model, run)
    assert out.finished_req_ids == {"b"}
    assert sched.kv_cache_manager.num_free_blocks < sched.kv_cache_manager.num_blocks
    sched.abort_requests("a")
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
    assert sched.schedule().finished_req_ids == {"a"}
    assert not sched.has_unfinished_requests()
    assert run.tokens("a") == chain(list(range(9)), 2)


def test_abort_between_schedule_and_update_drops_the_token(make):
    sched, model = make()
    sched.add_request(make_request("a", list(range(6)), max_tokens=5))
    sched.add_request(make_request("b", list(range(8)), max_tokens=5))
    out = sched.schedule()
    sampled = model.execute(out)
    sched.abort_requests("a")
    outputs = sched.update_from_output(out, sampled)
    assert [o.request_id for o in outputs] == ["b"]
    run = drive(sched, model)
    assert len(run.tokens("b")) == 4


def test_finish_requests_stops_from_outside(make):
    """What the output processor does when a stop string matches."""
    sched, model = make()
    req = make_request("r", list(range(6)), max_tokens=50)
    sched.add_request(req)
    run = Run()
    step(sched, model, run), step(sched, model, run)
    sched.finish_requests(["r"], RequestStatus.FINISHED_STOPPED)
    assert req.get_finish_reason() == "stop" and req.times.finished is not None
    assert sched.get_num_unfinished_requests() == 0
    with pytest.raises(ValueError, match="finished_status"):
        sched.finish_requests(["r"], RequestStatus.RUNNING)


# -- misuse is reported ---------------------------------------------------------------------

def test_bad_requests_and_configs_are_named(make):
    # (An empty or too long prompt is refused before: tests/test_input_processor.py.)
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="may need 5 KV blocks"):
        sched.add_request(make_request("big", list(range(10)), max_tokens=11))
    sched.add_request(make_request("ok", list(range(10)), max_tokens=7))  # 16 KV tokens
    with pytest.raises(ValueError, match="already in the scheduler"):
        sched.add_request(make_request("ok", [1]))
    sched.abort_requests("ok")
    with pytest.raises(ValueError, match="max_num_batched_tokens=0"):
        make(budget=0)
    with pytest.raises(ValueError, match="must be >= max_model_len"):
        make(budget=16, max_model_len=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="long_prefill_token_threshold=4"):
        make(budget=64, max_model_len=32, enable_chunked_prefill=False,
             long_prefill_token_threshold=4)


def test_steps_must_alternate_schedule_and_update(make):
    sched, model = make()
    sched.add_request(make_request("r", list(range(6)), max_tokens=2))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="before update_from_output"):
        sched.schedule()
    sampled = model.execute(out)
    with pytest.raises(ValueError, match="no token was sampled"):
        sched.update_from_output(out, {})
    assert sched.requests["r"].num_computed_tokens == 0  # nothing was applied
    sched.update_from_output(out, sampled)
    with pytest.raises(RuntimeError, match="already applied"):
        sched.update_from_output(out, sampled)
    with pytest.raises(ValueError, match="not scheduled"):
        sched.update_from_output(out, {"ghost": (1, None)})
    drive(sched, model)


def test_step_counters_add_up_to_the_pool_totals(make):
    sched, model = make(num_blocks=12, budget=16, max_num_seqs=3)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", [i] * 4 + list(range(9)), max_tokens=6))
    run = drive(sched, model)
    run.steps.append(sched.schedule())  # reports the frees of the last step
    pool = sched.kv_cache_manager.block_pool
    assert sum(s.num_blocks_allocated for s in run.steps) == pool.num_allocated
    assert sum(s.num_blocks_freed for s in run.steps) == pool.num_freed
    assert sum(s.num_blocks_evicted for s in run.steps) == pool.num_evicted
    assert pool.num_allocated > 0 and pool.num_evicted > 0


# -- invariants under random load -------------------------------------------------------------

@pytest.mark.parametrize("seed", range(16))
def test_random_workloads_keep_the_invariants(make, seed):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    max_model_len = 64
    chunked = rng.random() < 0.75
    sched, model = make(
        num_blocks=-(-max_model_len // block_size) + rng.randint(0, 6),
        block_size=block_size, max_model_len=max_model_len,
        budget=rng.choice([8, 16, 32]) if chunked else max_model_len,
        max_num_seqs=rng.randint(1, 6), caching=rng.random() < 0.8,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=rng.choice([0, 0, 6]) if chunked else 0)

    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    requests, arrival = [], {}
    for i in range(12):
        prompt = rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        params = {}
        if rng.random() < 0.3:
            params["stop_token_ids"] = [rng.randrange(VOCAB)]
        if rng.random() < 0.3:
            params["min_tokens"] = rng.randint(0, 3)
        req = make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 24),
                           eos=(rng.randrange(VOCAB),) if rng.random() < 0.5 else (),
                           **params)
        requests.append(req)
        arrival[req.request_id] = rng.randint(0, 25)
    aborts = {r.request_id: rng.randint(0, 40) for r in rng.sample(requests, 2)}

    run = Run()
    for t in range(5000):
        for req in requests:
            if arrival[req.request_id] == t:
                sched.add_request(req)
        for rid, when in aborts.items():
            if when == t:
                sched.abort_requests(rid)
        if t > max(arrival.values()) and not sched.has_unfinished_requests():
            break
        step(sched, model, run)
    else:
        raise AssertionError("workload did not finish")

    for req in requests:
        rid = req.request_id
        tokens = run.tokens(rid)
        ref_tokens, ref_reason = run_alone(req, max_model_len, block_size)
        if req.status == RequestStatus.FINISHED_ABORTED:
            assert tokens == ref_tokens[:len(tokens)]
        else:
            assert (tokens, run.finish_reason(rid)) == (ref_tokens, ref_reason)
            assert tokens == chain(req.prompt_token_ids, len(tokens))


def test_the_scheduler_reads_its_config_every_step(make):
    """The config is the scheduler's, not a copy: a budget changed on a live
    scheduler (as the book does) holds from the next step on."""
    sched, model = make(budget=8)
    req = make_request("a", list(range(30)), max_tokens=2)
    sched.add_request(req)
    run = Run()
    assert step(sched, model, run).num_scheduled_tokens == {"a": 8}
    sched.config.max_num_batched_tokens = 16
    assert step(sched, model, run).num_scheduled_tokens == {"a": 16}
    drive(sched, model, run)
    assert run.tokens("a") == chain(req.prompt_token_ids, 2)
