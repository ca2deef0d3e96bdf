"""One scheduling loop, no prefill/decode phases (vLLM V1 style).

Every request carries ``num_computed_tokens``: how many of its known tokens (prompt +
generated so far) already have K/V in the cache. Each step hands out a budget of
``max_num_batched_tokens`` tokens:

1. RUNNING requests first, oldest admitted first, each the rest of its known tokens (1 for
   a decode, the next chunk of a long prompt); while the KV cache has no room, the most
   recently admitted one is preempted (its blocks freed, to be recomputed later).
2. Then, if nobody was preempted, WAITING requests in arrival order while ``max_num_seqs``
   allows: the prefix cache may hold the start of the prompt; the rest is cut to the
   budget (chunked prefill), so a long prompt shares steps with others' decodes.

``schedule`` only decides; ``update_from_output`` applies the step's result (sampled
tokens; with drafts, a verified run: ``spec_decode_update.py``) and the token-level stop
conditions. A KV connector (``self.connector``) holds its requests aside while their KV
moves (``waiting_for_remote``, ``sending``), then puts them back in ``waiting``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

from minivllm.config import InvalidRequestError, SchedulerConfig
from minivllm.core.clock import MONOTONIC, Clock
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.outputs import EngineCoreOutput, LogprobInfo
from minivllm.core.request import Request, RequestStatus
from minivllm.core.request_queue import choose_victim, create_request_queue
from minivllm.core.sched_output import SchedulerOutput
from minivllm.core.stop_conditions import check_stop
from minivllm.feature_method import FeatureMethod

if TYPE_CHECKING:  # each loaded when its feature is used
    from minivllm.core.kv_connector_scheduling import KVConnectorScheduling
    from minivllm.core.spec_decode_stats import SpecDecodingStats


# Per request that reached the end of its known tokens: (sampled id, logprob info or None).
SampledTokens = dict[str, tuple[int, Optional[LogprobInfo]]]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, *,
                 clock: Optional[Clock] = None, max_loras: int = 0,
                 connector_scheduling: Optional[KVConnectorScheduling] = None) -> None:
        self.config = config  # checked there, once (minivllm/config/scheduler.py)
        self.max_model_len = config.max_model_len  # (read for every request and token)
        self.kv_cache_manager = kv_cache_manager
        self.clock = clock or MONOTONIC  # request timestamps (virtual in the simulator)
        kv_cache_manager.block_pool.clock = self.clock  # retention deadlines
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = create_request_queue(config.scheduling_policy)  # "fcfs" or "priority"
        self.running: list[Request] = []  # in admission order
        # Finished/aborted since the last schedule(), reported in its output.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self._num_added = 0
        self.step = 0
        self._pool_counters = (0, 0, 0)  # the block pool's at the last schedule()
        self._awaiting_output = False
        self.spec_decoding_stats: Optional[SpecDecodingStats] = None
        self.max_loras = max_loras  # multi-LoRA: distinct adapters at once (0: no LoRA)
        # What to ask a KV connector (kv_connector_scheduling.py), or None; its requests aside.
        self.connector = connector_scheduling
        self.waiting_for_remote = getattr(connector_scheduling, "waiting_for_remote", {})
        self.sending = getattr(connector_scheduling, "sending", {})

    # -- requests in and out -------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id={rid!r} is already in the scheduler")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"request {rid!r} has status={request.status.name}: "
                             "only WAITING requests can be added")
        # The input processor checked the prompt's length and max_tokens; only the scheduler
        # knows how many KV blocks exist (a request needing more would preempt itself forever).
        n = request.num_prompt_tokens  # (the last sampled token's K/V is never stored)
        longest = min(n + request.max_tokens, max(self.max_model_len, n + 1)) - 1
        need = self.kv_cache_manager.num_blocks_needed(longest)
        if need > self.kv_cache_manager.num_blocks:
            raise InvalidRequestError(
                f"request {rid!r} may need {need} KV blocks (prompt {n} + max_tokens "
                f"{request.max_tokens}, max_model_len {self.max_model_len}) but "
                f"the cache has {self.kv_cache_manager.num_blocks}: lower max_tokens "
                "or max_model_len, or give the cache more blocks", "max_tokens")
        self.requests[rid] = request
        request.queue_order = self._num_added
        self._num_added += 1
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus) -> None:
        """End requests from outside (abort, stop string); unknown ids are ignored."""
        if (not isinstance(finished_status, RequestStatus)
                or not RequestStatus.is_finished(finished_status)):
            raise ValueError(f"finished_status={finished_status!r} is invalid: must be "
                             "one of FINISHED_STOPPED, FINISHED_LENGTH_CAPPED, "
                             "FINISHED_ABORTED")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self._finish(request, finished_status)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus,
                stop_reason: Optional[int | str] = None) -> None:
        receiving = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not receiving:  # (a receiving one keeps its blocks until the transfer ends)
            self.waiting.remove(request)
        request.status = status
        request.stop_reason = stop_reason
        request.times.finished = self.clock.now()
        sending = self.connector is not None and self.connector.request_finished(request)
        if not sending and not receiving:  # (kept until sent, or until the KV has arrived)
            self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # -- counts --------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_remote)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    make_stats = FeatureMethod("minivllm.core.scheduler_stats", "make_scheduler_stats")

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # -- one step: decide ------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._awaiting_output:
            raise RuntimeError("schedule() called again before update_from_output() "
                               "applied the previous step")
        out = SchedulerOutput(step=self.step)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        # After a preemption the cache is short: new admissions would only be preempted too.
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        if self.connector is not None:  # after every allocation of the step
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        self._record_block_activity(out)
        self.step += 1
        self._awaiting_output = out.total_num_scheduled_tokens > 0
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._cap(request.num_tokens + request.num_output_placeholders
                                - request.num_computed_tokens
                                + len(self._drafts(request)), budget)
            if num_new < 1:
                raise RuntimeError(f"running request {request.request_id!r} has nothing "
                                   "to compute: was update_from_output() skipped?")
            while self.kv_cache_manager.allocate_slots(request, num_new) is None:
                victim = choose_victim(self.running, self.config.scheduling_policy)
                j = self.running.index(victim)
                if j < i:  # (priority only) scheduled earlier in this step: undo that
                    from minivllm.core.priority_queue import unschedule
                    budget += unschedule(self.kv_cache_manager, out, victim)
                    i -= 1
                self._preempt(victim, out)
                if victim is request:
                    return budget  # nothing less important left to preempt
            self._add_to_batch(out, request, num_new)
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv_cache_manager
        # Adapters of the running requests: a request for another one waits while
        # all max_loras slots are taken (it is passed over, nobody is evicted).
        loras = {r.lora_int_id for r in self.running} - {0}
        passed_over: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            lora_id = request.lora_int_id
            if lora_id and lora_id not in loras and len(loras) >= self.max_loras:
                passed_over.append(self.waiting.popleft())
                continue
            if self.connector is None:
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
                num_external, num_computed = 0, num_hit_tokens
            else:  # (prefix hits, then what the connector supplies from outside)
                found = self.connector.find_computed(request)
                if found.load_async:  # its KV arrives later: it waits aside, or for room
                    if not self.connector.allocate_for_async_load(request, found):
                        break
                    self.connector.park(self.waiting.popleft(), found.num_computed_tokens)
                    continue
                hit_blocks, num_hit_tokens, num_external, num_computed, _ = found
            num_new = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = self._cap(num_new, budget)
            if kv.allocate_slots(request, num_external + num_new, hit_blocks) is None:
                break  # FCFS: nobody overtakes the head of the queue
            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    request, kv.get_block_ids(request.request_id), num_external)
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            if request.times.first_scheduled is None:
                request.times.first_scheduled = self.clock.now()
            out.new_req_ids.append(request.request_id)
            out.num_prefix_cache_hit_tokens += num_hit_tokens
            out.num_external_computed_tokens += num_external
            self._add_to_batch(out, request, num_new)
            budget -= num_new
            if lora_id:
                loras.add(lora_id)
        for request in reversed(passed_over):  # back at the front, in their order
            self.waiting.appendleft(request)

    @staticmethod
    def _drafts(request: Request) -> list[int]:
        """The draft tokens to verify; drafts are stale unless one token is left."""
        if request.num_tokens - request.num_computed_tokens != 1:
            request.spec_token_ids, request.spec_token_probs = [], None
        return request.spec_token_ids

    def _cap(self, num_tokens: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            num_tokens = min(num_tokens, threshold)
        return min(num_tokens, budget)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free a running request's blocks; it will recompute from scratch."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_token_probs = [], None
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)  # it was admitted before anyone still waiting
        out.preempted_req_ids.append(request.request_id)

    def _add_to_batch(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        rid = request.request_id
        out.scheduled_requests.append(request)
        out.num_scheduled_tokens[rid] = num_new
        # The drafts the budget left: what is past the known tokens and placeholders.
        num_drafts = num_new - (request.num_tokens + request.num_output_placeholders
                                - request.num_computed_tokens)
        if num_drafts > 0:
            out.scheduled_spec_decode_tokens[rid] = request.spec_token_ids[:num_drafts]
        out.num_computed_tokens[rid] = request.num_computed_tokens
        out.block_ids[rid] = self.kv_cache_manager.get_block_ids(rid)

    def _record_block_activity(self, out: SchedulerOutput) -> None:
        """The step trace's block counts: allocated, freed, evicted since the last step."""
        pool = self.kv_cache_manager.block_pool
        counters = pool.num_allocated, pool.num_freed, pool.num_evicted
        out.num_blocks_allocated, out.num_blocks_freed, out.num_blocks_evicted = (
            now - before for now, before in zip(counters, self._pool_counters))
        self._pool_counters = counters

    # -- one step: apply -------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled: SampledTokens,
                           verified: Optional[dict[str, list]] = None,
                           kv_connector_output=None) -> list[EngineCoreOutput]:
        """Advance requests by the step's result; one output per new token or finish.
        ``sampled``: a token per request whose scheduled tokens reached the end of its known
        tokens (a partial prefill chunk, whose logits come from inside the prompt, gives
        none); ``verified``: per request that had drafts, the accepted ones plus one token of
        the target; ``kv_connector_output``: transfers finished, loads that failed."""
        verified = verified or {}
        step = scheduler_output.step
        unknown = set(sampled) - set(scheduler_output.num_scheduled_tokens)
        if unknown:
            raise ValueError(f"sampled tokens for requests not scheduled in step {step}: "
                             f"{sorted(unknown)}")
        # Requests finished from outside while the step ran are skipped.
        live = [r for r in scheduler_output.scheduled_requests if not r.is_finished()]
        for request in live:  # check everything before changing anything
            rid = request.request_id
            if request.num_computed_tokens != scheduler_output.num_computed_tokens[rid]:
                raise RuntimeError(f"step {step} was already applied to request {rid!r}")
            done = request.num_computed_tokens + scheduler_output.num_scheduled_tokens[rid]
            if done >= request.num_tokens and rid not in sampled and rid not in verified:
                raise ValueError(f"request {rid!r} reached the end of its tokens in step "
                                 f"{step} but no token was sampled for it")
        self._awaiting_output = False
        if kv_connector_output is not None and not kv_connector_output.is_empty:
            live = self.connector.apply_transfers(self, scheduler_output, live, kv_connector_output)
        outputs = []
        for request in live:
            rid = request.request_id
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid)
            if drafts:  # (speculative decoding: core/spec_decode_update.py)
                from minivllm.core.spec_decode_update import apply_verified
                outputs.append(apply_verified(self, request, scheduler_output, drafts,
                                              verified[rid]))
                continue
            request.num_computed_tokens += scheduler_output.num_scheduled_tokens[rid]
            if request.num_computed_tokens == request.num_tokens:
                outputs.append(self.append_tokens(request, [sampled[rid]]))
        return outputs

    def append_tokens(self, request: Request,
                       tokens: list[tuple[int, Optional[LogprobInfo]]]) -> EngineCoreOutput:
        """Append the step's token (or verified run), checking the stop conditions after
        each: a stop inside a run ends it, the tokens after it dropped as if never sampled."""
        new_ids, new_logprobs = [], []
        for token_id, info in tokens:
            # The token before this one is known now: its K/V (written this step) count.
            if new_ids:
                request.num_computed_tokens += 1
            new_ids.append(token_id)
            new_logprobs.append(info)
            request.append_output_token(token_id, self.clock.now())
            if info is not None:
                request.logprobs.append(info)
                request.cumulative_logprob += info[0]
            self.kv_cache_manager.update_block_hashes(request)
            stop = check_stop(request, self.max_model_len)
            if stop is not None:
                self._finish(request, *stop)
                break
        return EngineCoreOutput(
            request_id=request.request_id, new_token_ids=new_ids,
            new_logprobs=None if new_logprobs[0] is None else new_logprobs,
            finish_reason=request.get_finish_reason(), stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions,
            kv_transfer_params=request.kv_transfer_params)


__all__ = ["Scheduler", "SchedulerOutput", "SampledTokens"]
