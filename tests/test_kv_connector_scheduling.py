"""The scheduler with a KV connector (``KVConnectorScheduling``), chosen once.

Scheduler-level: the stand-in model of test_scheduler.py reads every token back
through the block table, and the test plays a connector's worker half on it,
writing the tokens a store supplies into the blocks the scheduler allocated (or
garbage, for a load that fails). Tokens must equal those of the plain token list
(``chain``) whatever the connector supplied, late or wrong; the tokens the store
supplied are not computed again. The engine-level equivalences (shared storage,
offloading, P2P against a plain engine) are in test_kv_transfer.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from minivllm.config import KVTransferConfig, SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_connector_scheduling import KVConnectorScheduling
from minivllm.core.request import RequestStatus
from minivllm.core.scheduler import Scheduler
from minivllm.distributed.kv_transfer.base import (KVCacheSpec, KVConnectorBase,
                                                   KVConnectorMetadata, KVConnectorOutput,
                                                   KVConnectorRole)
from tests.test_scheduler import PagedTokenModel, chain, make_request

BS = 4


@dataclass
class Loads(KVConnectorMetadata):
    # (request, its block ids, first position, end position) per load of the step.
    loads: list = field(default_factory=list)


class Store(KVConnectorBase):
    """Scheduler half of a store that holds the KV of the first ``held[rid]``
    prompt tokens of some requests; ``load_async``: they arrive steps later."""

    def __init__(self, held: dict[str, int], load_async: bool = False,
                 send: tuple[str, ...] = ()) -> None:
        super().__init__(KVTransferConfig("P2pConnector", "kv_both"),
                         KVConnectorRole.SCHEDULER, KVCacheSpec(BS, 1, 1))
        self.held, self.load_async, self.send = dict(held), load_async, set(send)
        self.hit: dict[str, int] = {}
        self.meta = Loads()
        self.holding: list[str] = []  # finished requests whose blocks it still sends
        self.failed: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = max(0, self.held.get(request.request_id, 0) - num_computed_tokens)
        self.hit[request.request_id] = num_computed_tokens
        return n, self.load_async and n > 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            start = self.hit[request.request_id]
            self.meta.loads.append((request, list(block_ids), start, start + num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        meta, self.meta = self.meta, Loads()
        return meta

    def request_finished(self, request, block_ids):
        hold = request.request_id in self.send
        if hold:
            self.holding.append(request.request_id)
        return hold, {"sent": hold}

    def request_load_failed(self, request):
        self.held.pop(request.request_id)
        self.failed.append(request.request_id)


class Worker:
    """The store's worker half on the stand-in model: a load writes the prompt's
    tokens (or, for ``corrupt`` requests, garbage) into the allocated slots."""

    def __init__(self, model: PagedTokenModel, store: Store, delay: int = 0,
                 corrupt: tuple[str, ...] = ()) -> None:
        self.model, self.store, self.delay, self.corrupt = model, store, delay, set(corrupt)
        self.arriving: list[tuple[int, str, set[int]]] = []  # (step due, rid, bad blocks)
        self.step = 0

    def run(self, meta: Loads) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for request, block_ids, start, end in meta.loads:
            rid, bad = request.request_id, set()
            for pos in range(start, end):
                token = request.all_token_ids[pos]
                if rid in self.corrupt:
                    token, bad = token + 1, bad | {block_ids[pos // BS]}
                self.model.slots[self.model._slot(block_ids, pos)] = token
            if self.store.load_async:
                self.arriving.append((self.step + self.delay, rid, bad))
            else:
                out.invalid_block_ids |= bad
        for due, rid, bad in [a for a in self.arriving if a[0] <= self.step]:
            self.arriving.remove((due, rid, bad))
            out.finished_recving.add(rid)
            out.invalid_block_ids |= bad
        out.finished_sending, self.store.holding = set(self.store.holding), []
        self.step += 1
        return out


def make(store: Store | None, num_blocks: int = 64, budget: int = 32):
    kv = KVCacheManager(num_blocks, BS)
    scheduling = None if store is None else KVConnectorScheduling(store, kv)
    sched = Scheduler(SchedulerConfig(budget, 8, 128), kv, connector_scheduling=scheduling)
    return sched, PagedTokenModel(num_blocks, BS)


def drive(sched: Scheduler, model: PagedTokenModel, worker: Worker | None):
    """Step to the end; returns (tokens per request, steps with what each computed)."""
    tokens, steps = defaultdict(list), []
    for _ in range(500):
        if not (sched.has_unfinished_requests() or sched.sending):
            break
        so = sched.schedule()
        kv_out = None if worker is None else worker.run(so.kv_connector_metadata)
        sampled = model.execute(so)
        for o in sched.update_from_output(so, sampled, kv_connector_output=kv_out):
            tokens[o.request_id] += o.new_token_ids
        steps.append((dict(so.num_scheduled_tokens), set(sched.waiting_for_remote)))
    else:
        raise AssertionError("requests did not finish")
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_to_blocks
    return tokens, steps


def requests(n: int = 3, max_tokens: int = 5):
    return [make_request(f"r{i}", [(7 * i + 3 * j + 1) % 60 for j in range(22)],
                         max_tokens=max_tokens + 4 * i) for i in range(n)]


def want(reqs) -> dict:
    return {r.request_id: chain(r.prompt_token_ids, r.max_tokens) for r in reqs}


def test_without_a_connector_the_scheduler_never_asks_one(tiny_model):
    """Chosen once, in the engine core: without ``kv_transfer_config`` the
    scheduler holds None and the connector scheduling code is not even imported."""
    code = (f"import sys; from minivllm import LLM, SamplingParams; "
            f"llm = LLM({str(tiny_model('llama'))!r}, cpu_kernels=False, num_kv_blocks=64); "
            f"llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False); "
            f"assert llm.engine_core.scheduler.connector is None; "
            f"assert 'minivllm.core.kv_connector_scheduling' not in sys.modules; "
            f"llm.shutdown()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_with_a_connector_the_engine_core_hands_the_scheduler_one(tiny_model, tmp_path):
    from minivllm import LLM

    llm = LLM(tiny_model("llama"), cpu_kernels=False, num_kv_blocks=64,
              kv_transfer_config={"kv_connector": "SharedStorageConnector",
                                  "kv_connector_extra_config":
                                      {"shared_storage_path": str(tmp_path)}})
    try:
        core = llm.engine_core
        assert isinstance(core.scheduler.connector, KVConnectorScheduling)
        assert core.scheduler.connector.connector is core.kv_connector
        assert core.scheduler.config is core.config.scheduler  # its config, not a copy
    finally:
        llm.shutdown()


@pytest.mark.parametrize("load_async", [False, True])
def test_supplied_kv_is_not_computed_again_and_the_tokens_hold(load_async):
    reqs = requests()
    held = {"r0": 12, "r2": 20}  # full blocks of the 22-token prompts
    store = Store(held, load_async=load_async)
    sched, model = make(store)
    for r in reqs:
        sched.add_request(r)
    tokens, steps = drive(sched, model, Worker(model, store, delay=3))
    assert tokens == want(reqs)
    computed = sum(n for scheduled, _ in steps for n in scheduled.values())
    assert computed == sum(22 + r.max_tokens - 1 for r in reqs) - sum(held.values())
    assert [r.num_cached_tokens for r in reqs] == [12, 0, 20]
    if load_async:  # the others stepped while r0 and r2 waited aside for their KV
        aside = [scheduled for scheduled, parked in steps if parked == {"r0", "r2"}]
        assert len(aside) >= 3 and all(set(s) == {"r1"} for s in aside)


@pytest.mark.parametrize("load_async", [False, True])
def test_a_failed_load_is_recomputed_and_never_offered_again(load_async):
    reqs = requests()
    store = Store({"r0": 12, "r1": 16}, load_async=load_async)
    sched, model = make(store)
    for r in reqs:
        sched.add_request(r)
    tokens, _ = drive(sched, model, Worker(model, store, delay=2, corrupt=("r1",)))
    # (Synchronous, r1's bad blocks were in the prefix cache: had they stayed, its
    # recompute would have found them there and read the garbage.)
    assert tokens == want(reqs)
    assert store.failed == ["r1"] and [r.num_cached_tokens for r in reqs] == [12, 0, 0]


def test_blocks_being_sent_stay_until_the_worker_reports_them_sent():
    reqs = requests(2)
    store = Store({}, send=("r0",))
    sched, model = make(store)
    for r in reqs:
        sched.add_request(r)
    tokens = defaultdict(list)
    while "r0" not in sched.sending:  # (no worker: nothing reports the send)
        so = sched.schedule()
        for o in sched.update_from_output(so, model.execute(so)):
            tokens[o.request_id] += o.new_token_ids
    assert reqs[0].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert reqs[0].kv_transfer_params == {"sent": True}
    assert sched.kv_cache_manager.get_block_ids("r0")  # still held
    rest, _ = drive(sched, model, Worker(model, store))  # reports the send: freed
    assert {"r0": tokens["r0"], "r1": tokens["r1"] + rest["r1"]} == want(reqs)
    assert not sched.sending
