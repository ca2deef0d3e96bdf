"""One token budget per step: running requests first, then waiting ones (chapter 7).

A long prompt is cut to what is left of the budget (chunked prefill); when the
KV cache has no block for a running request, the newest running request is
preempted: its blocks are freed and it starts over later, prompt and answer so
far recomputed as one prefill. The names are the engine's, so the engine's own
``Scheduler`` can take this one's place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


class Sequence:
    """One request as the scheduler sees it: its tokens and how many are in the cache."""

    def __init__(self, request_id: str, prompt_token_ids, sampling_params, max_tokens: int,
                 eos_token_ids=frozenset()):
        self.request_id, self.sampling_params = request_id, sampling_params
        self.prompt_token_ids, self.output_token_ids = list(prompt_token_ids), []
        self.all_token_ids = list(prompt_token_ids)  # prompt + answer so far
        self.max_tokens, self.eos_token_ids = max_tokens, eos_token_ids
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.finish_reason: Optional[str] = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class SchedulerOutput:
    scheduled_requests: list = field(default_factory=list)  # batch order
    num_scheduled_tokens: dict = field(default_factory=dict)  # id -> tokens this step
    num_computed_tokens: dict = field(default_factory=dict)  # id -> in the cache before it
    block_ids: dict = field(default_factory=dict)  # id -> its block table
    preempted_req_ids: list = field(default_factory=list)


@dataclass
class TokenOutput:
    request_id: str
    new_token_ids: list
    finish_reason: Optional[str]


class Scheduler:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, kv_cache_manager):
        self.budget, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.kv_cache_manager = kv_cache_manager
        self.waiting: list[Sequence] = []  # first come, first served
        self.running: list[Sequence] = []  # in admission order

    def add_request(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out, left = SchedulerOutput(), self.budget
        for seq in list(self.running):  # 1. running requests, oldest first
            if left == 0 or seq not in self.running:  # (it may just have been preempted)
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, left)
            while self.kv_cache_manager.allocate_slots(seq, num_new) is None:
                self._preempt(self.choose_victim(), out)
                if seq not in self.running:
                    break
            else:
                self._add(out, seq, num_new)
                left -= num_new
        while (self.waiting and left > 0 and len(self.running) < self.max_num_seqs
               and not out.preempted_req_ids):  # 2. admit, unless the cache just ran short
            seq = self.waiting[0]
            num_new = min(seq.num_tokens, left)  # a long prompt: only its first chunk
            if self.kv_cache_manager.allocate_slots(seq, num_new) is None:
                break  # nobody overtakes the head of the queue
            self.running.append(self.waiting.pop(0))
            self._add(out, seq, num_new)
            left -= num_new
        return out

    def choose_victim(self) -> Sequence:
        return self.running[-1]  # the newest: it has the least work to lose

    def _add(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        rid = seq.request_id
        out.scheduled_requests.append(seq)
        out.num_scheduled_tokens[rid] = num_new
        out.num_computed_tokens[rid] = seq.num_computed_tokens
        out.block_ids[rid] = self.kv_cache_manager.get_block_ids(rid)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.num_computed_tokens = 0  # recomputed from scratch: prompt + answer so far
        self.waiting.insert(0, seq)  # it was admitted before anyone still waiting
        out.preempted_req_ids.append(seq.request_id)

    def update_from_output(self, out: SchedulerOutput, sampled: dict) -> list[TokenOutput]:
        """``sampled``: request id -> (token, logprob info) for rows that reached the end."""
        outputs = []
        for seq in out.scheduled_requests:
            seq.num_computed_tokens += out.num_scheduled_tokens[seq.request_id]
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a middle chunk of a prompt: no token yet
            token = sampled[seq.request_id][0]
            seq.output_token_ids.append(token)
            seq.all_token_ids.append(token)
            if token in seq.eos_token_ids and not seq.sampling_params.ignore_eos:
                seq.finish_reason = "stop"
            elif len(seq.output_token_ids) >= seq.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason:
                self.running.remove(seq)
                self.kv_cache_manager.free(seq)
            outputs.append(TokenOutput(seq.request_id, [token], seq.finish_reason))
        return outputs
