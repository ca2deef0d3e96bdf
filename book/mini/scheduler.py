"""One token budget per step: running requests first, then waiting ones (chapter 7).

A long prompt is cut to what is left of the budget (chunked prefill); when the
KV cache has no block for a running request, the newest running request is
preempted: its blocks are freed and it starts over later, prompt and answer so
far recomputed as one prefill. The names are the engine's, so the engine's own
``Scheduler`` can take this one's place.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field


class Sequence:
    """One request as the scheduler sees it: its tokens and how many are in the cache."""

    def __init__(self, request_id: str, prompt_token_ids, sampling_params, eos_token_ids=()):
        self.request_id, self.sampling_params = request_id, sampling_params
        self.all_token_ids = list(prompt_token_ids)  # prompt + answer so far
        self.num_prompt_tokens, self.eos_token_ids = len(self.all_token_ids), eos_token_ids
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class SchedulerOutput:
    scheduled_requests: list = field(default_factory=list)  # batch order
    num_scheduled_tokens: dict = field(default_factory=dict)  # id -> tokens this step
    block_ids: dict = field(default_factory=dict)  # id -> its block table
    total_num_scheduled_tokens: int = 0  # of the budget
    preempted_req_ids: list = field(default_factory=list)


# What one step gives back for one request that got a token.
TokenOutput = namedtuple("TokenOutput", "request_id new_token_ids finish_reason")


class Scheduler:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, kv_cache_manager):
        self.budget, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.kv_cache_manager = kv_cache_manager
        self.waiting, self.running = [], []  # first come first served; admission order

    def add_request(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for seq in list(self.running):  # 1. running requests, oldest first
            if self.budget == out.total_num_scheduled_tokens or seq not in self.running:
                break  # budget spent, or seq (so everyone newer) just preempted
            while seq in self.running and not self._add(out, seq):  # no free block:
                self._preempt(self.running[-1], out)  # the newest has least work to lose
        while (self.waiting and self.budget > out.total_num_scheduled_tokens
               and len(self.running) < self.max_num_seqs
               and not out.preempted_req_ids):  # 2. admit, unless the cache just ran short
            if not self._add(out, self.waiting[0]):
                break  # nobody overtakes the head of the queue
            self.running.append(self.waiting.pop(0))
        return out

    def _add(self, out: SchedulerOutput, seq: Sequence) -> bool:
        """Schedule what the budget leaves of ``seq``'s uncomputed tokens, if blocks allow."""
        rid, left = seq.request_id, self.budget - out.total_num_scheduled_tokens
        num_new = min(seq.num_tokens - seq.num_computed_tokens, left)  # maybe a chunk
        if self.kv_cache_manager.allocate_slots(seq, num_new) is None:
            return False
        out.scheduled_requests.append(seq)
        out.num_scheduled_tokens[rid] = num_new
        out.total_num_scheduled_tokens += num_new
        out.block_ids[rid] = self.kv_cache_manager.block_tables[rid]
        return True

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
            seq.all_token_ids.append(token)
            stop = token in seq.eos_token_ids and not seq.sampling_params.ignore_eos
            length = seq.num_tokens - seq.num_prompt_tokens >= seq.sampling_params.max_tokens
            reason = "stop" if stop else "length" if length else None
            if reason:
                self.running.remove(seq)
                self.kv_cache_manager.free(seq)
            outputs.append(TokenOutput(seq.request_id, [token], reason))
        return outputs
