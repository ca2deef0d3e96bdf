"""Token IDs from the engine core → text, stop strings, ``RequestOutput``s.

This runs on the API side (the caller's process). For each request it keeps
an incremental detokenizer and a stop-string checker; it turns the core's
per-step token deltas into ``RequestOutput``s of the kind the caller asked
for (cumulative, delta for streaming, or final only), and it reports which
requests a stop string has ended, so the core can free them.

``n > 1``: one parent request fans out into ``n`` child requests in the core
(they share the prompt's KV blocks through the prefix cache); the parent
gathers its children's completions here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from minivllm.config import InvalidRequestError
from minivllm.core.outputs import EngineCoreOutput
from minivllm.core.request import Request
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.metrics.request_metrics import RequestMetrics
from minivllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.stop_checker import StopStringChecker  # (loaded by the first
    from minivllm.inputs import EngineCoreRequest              # request with stop strings)


@dataclass
class ChildState:
    """One completion being generated (the only child when n == 1)."""

    request_id: str
    index: int
    params: SamplingParams
    detokenizer: Optional[IncrementalDetokenizer]
    stop_checker: Optional[StopStringChecker]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for DELTA outputs: what the caller has already seen
    sent_chars: int = 0
    sent_logprobs: int = 0
    num_preemptions: int = 0  # as last reported by the core

    def completion(self, delta: bool) -> CompletionOutput:
        tok0, chr0, lp0 = ((self.sent_tokens, self.sent_chars, self.sent_logprobs)
                           if delta else (0, 0, 0))
        out = CompletionOutput(
            index=self.index, text=self.text[chr0:], token_ids=self.token_ids[tok0:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[lp0:],
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        self.sent_tokens, self.sent_chars = len(self.token_ids), len(self.text)
        self.sent_logprobs = len(self.logprobs or [])
        return out


@dataclass
class RequestState:
    """One user request (the parent of its n children)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    children: list[ChildState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    kv_transfer_params: Optional[dict] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    sent_prompt_logprobs: bool = False  # DELTA outputs carry them once

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of n completions gets its own seed (seed + index) so they differ."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return params.clone(n=1, seed=seed)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request: EngineCoreRequest) -> list[Request]:
        """Track a request the input processor accepted; returns the core ``Request``
        of each of its ``n`` completions (children), for the engine core to run."""
        request_id, params = request.request_id, request.sampling_params
        prompt, prompt_token_ids = request.prompt, request.prompt_token_ids
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id={request_id!r} is already in use",
                                      "request_id")
        children, core_requests = [], []
        for i in range(params.n):
            cid = child_request_id(request_id, i, params.n)
            p = child_params(params, i)
            core_requests.append(Request(cid, prompt_token_ids, p, request.max_tokens,
                                         request.eos_token_ids, request.arrival_time,
                                         request.priority, request.lora_request))
            detok = (IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens)
                     if p.detokenize and self.tokenizer is not None else None)
            children.append(ChildState(cid, i, p, detok, _stop_checker(p),
                                       logprobs=[] if p.logprobs is not None else None,
                                       cumulative_logprob=0.0 if p.logprobs is not None
                                       else None))
            self.child_to_parent[cid] = request_id
        self.requests[request_id] = RequestState(
            request_id, prompt, list(prompt_token_ids), params.output_kind, children,
            RequestMetrics(arrival_time=request.arrival_time,
                           num_prompt_tokens=len(prompt_token_ids),
                           completion_token_times=[[] for _ in range(params.n)]))
        return core_requests

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return [] if state is None else [c.request_id for c in state.children]

    # -- one step's outputs --------------------------------------------------
    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """(RequestOutputs to hand to callers, child ids a stop string has ended)."""
        touched: dict[str, RequestState] = {}
        stopped_by_string: list[str] = []
        for o in outputs:
            parent_id = self.child_to_parent.get(o.request_id)
            if parent_id is None:
                continue  # aborted on this side while the step ran
            state = self.requests[parent_id]
            child = next(c for c in state.children if c.request_id == o.request_id)
            if child.finish_reason is not None:
                continue
            if self._apply(state, child, o):
                stopped_by_string.append(child.request_id)
            touched[parent_id] = state
        results = [r for s in touched.values() if (r := self._make_output(s)) is not None]
        return results, stopped_by_string

    def _apply(self, state: RequestState, child: ChildState, o: EngineCoreOutput) -> bool:
        """Apply one core output to a child; True if a stop string finished it."""
        m = state.metrics
        # n > 1: the children are scheduled on their own; the parent was
        # scheduled when its first child was.
        if o.first_scheduled_time is not None and (
                m.first_scheduled_time is None
                or o.first_scheduled_time < m.first_scheduled_time):
            m.first_scheduled_time = o.first_scheduled_time
        if child.index == 0:  # the children share the prompt: one count is enough
            state.num_cached_tokens = max(o.num_cached_tokens, 0)
            m.num_cached_tokens = state.num_cached_tokens
            if o.kv_transfer_params is not None:
                state.kv_transfer_params = o.kv_transfer_params
            if o.prompt_logprobs is not None:
                from minivllm.engine.logprobs import prompt_logprobs

                state.prompt_logprobs = prompt_logprobs(state.prompt_token_ids,
                                                        o.prompt_logprobs, self._token_text)
        # Each child reports its own running total of preemptions.
        m.num_preemptions += o.num_preemptions - child.num_preemptions
        child.num_preemptions = o.num_preemptions
        if o.num_draft_tokens:
            m.record_spec_decode(o.num_draft_tokens, o.num_accepted_tokens)
        if len(o.new_token_ids) > 1 and child.stop_checker is not None:
            return self._apply_run(state, child, o)
        m.record_tokens(len(o.new_token_ids), o.timestamp, child.index)
        child.token_ids.extend(o.new_token_ids)
        if o.new_logprobs is not None and child.logprobs is not None:
            from minivllm.engine.logprobs import sample_logprobs

            for token_id, (chosen, top) in zip(o.new_token_ids, o.new_logprobs):
                child.logprobs.append(sample_logprobs(token_id, chosen, top, self._token_text))
                child.cumulative_logprob += chosen
        matched = False
        if child.detokenizer is not None:
            text = child.detokenizer.update(o.new_token_ids)
            if o.finished:
                text += child.detokenizer.finish()
            stop = None
            if child.stop_checker is not None:
                text, stop = child.stop_checker.process(text)
                if stop is None and o.finished:
                    text += child.stop_checker.finish()
            child.text += text
            if stop is not None:
                child.finish_reason, child.stop_reason = "stop", stop
                matched = not o.finished  # the core must still be told to stop it
        if o.finished and child.finish_reason is None:
            child.finish_reason, child.stop_reason = o.finish_reason, o.stop_reason
        if state.finished:
            m.finished_time = o.timestamp
        return matched

    def _apply_run(self, state: RequestState, child: ChildState, o: EngineCoreOutput) -> bool:
        """Several tokens at once (a verified speculative run) with stop strings:
        one token at a time, so a stop string ends the run at the token that
        completes it, exactly as without speculation."""
        ids, lps = o.new_token_ids, o.new_logprobs
        for i, token_id in enumerate(ids):
            last = i == len(ids) - 1
            one = dataclasses.replace(
                o, new_token_ids=[token_id], new_logprobs=None if lps is None else [lps[i]],
                finish_reason=o.finish_reason if last else None,
                stop_reason=o.stop_reason if last else None, num_draft_tokens=0)
            matched = self._apply(state, child, one)
            if child.finish_reason is not None:
                return matched
        return False

    def _token_text(self, token_id: int) -> Optional[str]:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_output(self, state: RequestState) -> Optional[RequestOutput]:
        finished = state.finished
        kind = state.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = [c.completion(delta) for c in state.children]
        if finished:
            self._forget(state)
        prompt_logprobs = None if delta and state.sent_prompt_logprobs else state.prompt_logprobs
        state.sent_prompt_logprobs = state.prompt_logprobs is not None
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, outputs=completions,
            finished=finished, num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics, prompt_logprobs=prompt_logprobs,
            kv_transfer_params=state.kv_transfer_params)

    # -- aborts --------------------------------------------------------------
    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Finish a request on this side ("abort"); returns its last output."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for c in state.children:
            if c.finish_reason is None:
                c.finish_reason = "abort"
        return self._make_output(state)

    def _forget(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for c in state.children:
            self.child_to_parent.pop(c.request_id, None)


def _stop_checker(params: SamplingParams) -> Optional[StopStringChecker]:
    """A checker for the request's stop strings (None: it has none)."""
    if not params.stop:
        return None
    from minivllm.engine.stop_checker import StopStringChecker

    return StopStringChecker(params.stop, params.include_stop_str_in_output)
