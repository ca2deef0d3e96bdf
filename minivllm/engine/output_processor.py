"""Token IDs from the engine core → text, stop strings, ``RequestOutput``s (API side).

Per request an incremental detokenizer and a stop-string checker turn the core's
token deltas into outputs of the kind asked for (cumulative, delta, final only),
and report which requests a stop string ended, for the core to free. ``n > 1`` runs
as ``n`` core requests gathered into one output (``parallel_sampling.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from minivllm.config import InvalidRequestError
from minivllm.core.outputs import EngineCoreOutput
from minivllm.core.request import Request
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.feature_method import FeatureMethod
from minivllm.metrics.request_metrics import RequestMetrics
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # (each loaded by the first request that needs it)
    from minivllm.engine.logprobs import LogprobsProcessor
    from minivllm.engine.parallel_sampling import ParentRequest
    from minivllm.engine.stop_checker import StopStringChecker
    from minivllm.inputs import EngineCoreRequest


@dataclass
class RequestState:
    """One core request: a caller's request, or one of the ``n`` completions of one."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: Optional[IncrementalDetokenizer]
    stop_checker: Optional[StopStringChecker]
    metrics: RequestMetrics  # shared by the n completions of one request
    index: int = 0  # which completion
    parent: Optional[ParentRequest] = None  # n > 1 only
    logprobs: Optional[LogprobsProcessor] = None  # (logprobs or prompt_logprobs asked)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    # DELTA outputs: what the caller has already seen.
    sent_tokens: int = 0
    sent_chars: int = 0
    num_preemptions: int = 0  # as last reported by the core
    num_cached_tokens: int = 0
    kv_transfer_params: Optional[dict] = None
    pooling_output: Optional[list[float]] = None  # a pooling request's vector

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, delta: bool) -> CompletionOutput:
        tok0, chr0 = (self.sent_tokens, self.sent_chars) if delta else (0, 0)
        out = CompletionOutput(
            index=self.index, text=self.text[chr0:], token_ids=self.token_ids[tok0:],
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        if self.logprobs is not None:
            out.logprobs, out.cumulative_logprob = self.logprobs.take_logprobs(delta)
        self.sent_tokens, self.sent_chars = len(self.token_ids), len(self.text)
        return out


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}  # by core request id
        self.parents: dict[str, ParentRequest] = {}  # n > 1: by the caller's request id

    def add_request(self, request: EngineCoreRequest) -> list[Request]:
        """Track a request the input processor accepted; returns the core ``Request``
        of each of its ``n`` completions, for the engine core to run."""
        request_id, params = request.request_id, request.sampling_params
        if request_id in self.requests or request_id in self.parents:
            raise InvalidRequestError(f"request_id={request_id!r} is already in use",
                                      "request_id")
        metrics = RequestMetrics(arrival_time=request.arrival_time,
                                 num_prompt_tokens=len(request.prompt_token_ids),
                                 completion_token_times=[[] for _ in range(params.n)])
        if params.n == 1:
            return [self.add_completion(request, request_id, params, metrics)]
        from minivllm.engine.parallel_sampling import add_parent
        return add_parent(self, request, metrics)

    def add_completion(self, request: EngineCoreRequest, request_id: str,
                       params: SamplingParams, metrics: RequestMetrics, index: int = 0,
                       parent: Optional[ParentRequest] = None) -> Request:
        """Track one completion (a core request) of ``request``; its core ``Request``."""
        detok = (IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                 if params.detokenize and self.tokenizer is not None else None)
        logprobs = stop_checker = None  # (each loaded by the first request that asks)
        if params.logprobs is not None or params.prompt_logprobs is not None:
            from minivllm.engine.logprobs import LogprobsProcessor
            logprobs = LogprobsProcessor(params, request.prompt_token_ids, index, self.tokenizer)
        if params.stop:
            from minivllm.engine.stop_checker import StopStringChecker
            stop_checker = StopStringChecker(params.stop, params.include_stop_str_in_output)
        state = RequestState(request_id, request.prompt, list(request.prompt_token_ids),
                             params, detok, stop_checker, metrics, index, parent, logprobs)
        self.requests[request_id] = state
        if parent is not None:
            parent.children.append(state)
        return Request(request_id, request.prompt_token_ids, params, request.max_tokens,
                       request.eos_token_ids, request.arrival_time, request.priority,
                       request.lora_request, request.cache_salt)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # The callers' unfinished requests (one with n completions counts once); a caller's
    # request -> its core requests; a core request -> its caller's; finishing a caller's
    # request on this side ("abort"), returning its last output.
    get_num_unfinished_requests = FeatureMethod("minivllm.engine.parallel_sampling")
    child_ids = FeatureMethod("minivllm.engine.abort")
    parent_id = FeatureMethod("minivllm.engine.parallel_sampling")
    abort_request = FeatureMethod("minivllm.engine.abort")

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """(RequestOutputs to hand to callers, core request ids a stop string has ended)."""
        touched: dict[str, list[RequestState]] = {}
        stopped_by_string: list[str] = []
        for o in outputs:
            state = self.requests.get(o.request_id)
            if state is None or state.finished:
                continue  # aborted on this side while the step ran
            if self._apply(state, o):
                stopped_by_string.append(o.request_id)
            if state.parent is None:
                touched[state.request_id] = [state]
            else:
                touched[state.parent.request_id] = state.parent.children
        results = [r for rid, states in touched.items()
                   if (r := self.make_output(rid, states)) is not None]
        return results, stopped_by_string

    def _apply(self, state: RequestState, o: EngineCoreOutput) -> bool:
        """Apply one core output to its request; True if a stop string finished it."""
        m = state.metrics
        t = o.first_scheduled_time  # (n > 1: when its first completion was)
        if t is not None and (m.first_scheduled_time is None or t < m.first_scheduled_time):
            m.first_scheduled_time = t
        if state.index == 0:  # the completions share the prompt: one count is enough
            state.num_cached_tokens = max(o.num_cached_tokens, 0)
            m.num_cached_tokens = state.num_cached_tokens
            if o.kv_transfer_params is not None:
                state.kv_transfer_params = o.kv_transfer_params
            state.pooling_output = o.pooling_output or state.pooling_output
        # Each completion reports its own running total of preemptions.
        m.num_preemptions += o.num_preemptions - state.num_preemptions
        state.num_preemptions = o.num_preemptions
        if o.num_draft_tokens:
            m.record_spec_decode(o.num_draft_tokens, o.num_accepted_tokens)
        if len(o.new_token_ids) > 1 and state.stop_checker is not None:  # verified drafts
            return state.stop_checker.apply_run(self._apply, state, o)
        m.record_tokens(len(o.new_token_ids), o.timestamp, state.index)
        state.token_ids.extend(o.new_token_ids)
        if state.logprobs is not None:
            state.logprobs.update_from_output(o)
        matched = False
        if state.detokenizer is not None:
            text = state.detokenizer.update(o.new_token_ids)
            if o.finished:
                text += state.detokenizer.finish()
            stop = None
            if state.stop_checker is not None:
                text, stop = state.stop_checker.process(text)
                if stop is None and o.finished:
                    text += state.stop_checker.finish()
            state.text += text
            if stop is not None:
                state.finish_reason, state.stop_reason = "stop", stop
                matched = not o.finished  # the core must still be told to stop it
        if o.finished and state.finish_reason is None:
            state.finish_reason, state.stop_reason = o.finish_reason, o.stop_reason
        if (state.parent or state).finished:
            m.finished_time = o.timestamp
        return matched

    def make_output(self, request_id: str, states: list[RequestState]) -> Optional[RequestOutput]:
        """A caller's request's output from its completions' states (the first has the
        prompt's numbers)."""
        first = states[0]
        finished = all(s.finished for s in states)
        kind = first.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = [s.completion(delta) for s in states]
        if finished:
            self._forget(request_id, states)
        prompt_logprobs = first.logprobs and first.logprobs.take_prompt_logprobs(delta)
        return RequestOutput(
            request_id=request_id, prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids, outputs=completions,
            finished=finished, num_cached_tokens=first.num_cached_tokens,
            metrics=first.metrics, prompt_logprobs=prompt_logprobs,
            kv_transfer_params=first.kv_transfer_params, pooling_output=first.pooling_output)

    def _forget(self, request_id: str, states: list[RequestState]) -> None:
        self.parents.pop(request_id, None)
        for s in states:
            self.requests.pop(s.request_id, None)
