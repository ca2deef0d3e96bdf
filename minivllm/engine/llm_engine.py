"""The synchronous engine: input processing + engine core + output processing.

    prompt ──InputProcessor──▶ token IDs ──EngineCore.step()──▶ new token IDs
                                                   │
            RequestOutput ◀──OutputProcessor───────┘  (text, stop strings, metrics)

``LLM`` (offline) drives it in a loop; the server uses the same processors
around an engine core that lives in another process.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

from minivllm.config import EngineArgs, EngineConfig, check_int
from minivllm.engine.core_builder import build_engine_core
from minivllm.engine.output_processor import OutputProcessor, child_params
from minivllm.core.request import Request, RequestStatus
from minivllm.lora.checker import LoRARequestChecker
from minivllm.inputs import InputProcessor, PromptType, load_tokenizer, read_eos_token_ids
from minivllm.model.resolve import resolve_engine_config
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class RequestBuilder:
    """Prompt + params -> the core ``Request``s (one per completion when n > 1)."""

    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model.path)
        self.eos_token_ids = read_eos_token_ids(config.model.path, self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, config.scheduler.max_model_len, config.model.vocab_size)
        self.lora_checker = LoRARequestChecker(config.lora, config.model)

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        return self.input_processor.tokenize(prompt)

    def check_priority(self, priority: int) -> None:
        """vLLM's rule: a priority other than 0 needs scheduling_policy="priority"."""
        check_int("priority", priority)
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} is invalid with scheduling_policy="
                             f"{self.config.scheduler.scheduling_policy!r}: start the engine "
                             "with scheduling_policy='priority' (--scheduling-policy priority)")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against this model; returns its resolved max_tokens.

        Call it before registering the request anywhere, so a bad one leaves no trace.
        """
        max_tokens = self.input_processor.check_length(len(prompt_token_ids), params)
        vocab = self.config.model.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids contains {bad[:5]}: token IDs "
                             f"must be in [0, {vocab})")
        return max_tokens

    def process(self, prompt: PromptType, params: SamplingParams, priority: int = 0,
                lora_request=None) -> tuple[Optional[str], list[int]]:
        """Tokenize and check everything about a request before it is registered
        anywhere, so a bad one leaves no trace; returns (text, prompt token IDs)."""
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        self.check_priority(priority)
        self.lora_checker.check(lora_request)
        return text, token_ids

    def build(self, child_ids: list[str], prompt_token_ids: list[int],
              params: SamplingParams, arrival_time: float,
              priority: int = 0, lora_request=None) -> list[Request]:
        """The core requests of a request ``process`` accepted."""
        max_tokens = self.input_processor.check_length(len(prompt_token_ids), params)
        return [Request(cid, prompt_token_ids, child_params(params, i), max_tokens,
                        self.eos_token_ids, arrival_time, priority, lora_request)
                for i, cid in enumerate(child_ids)]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.request_builder = RequestBuilder(config)
        self.tokenizer = self.request_builder.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = build_engine_core(config)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(resolve_engine_config(args))

    # -- requests ------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams,
                    request_id: Optional[str] = None,
                    arrival_time: Optional[float] = None, priority: int = 0,
                    lora_request=None) -> str:
        request_id = str(next(self._ids)) if request_id is None else request_id
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        text, token_ids = self.request_builder.process(prompt, params, priority, lora_request)
        child_ids = self.output_processor.add_request(request_id, text, token_ids, params,
                                                      arrival_time)
        for req in self.request_builder.build(child_ids, token_ids, params, arrival_time,
                                              priority, lora_request):
            self.engine_core.add_request(req)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.engine_core.abort_requests(self.output_processor.child_ids(rid))
            self.output_processor.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # -- the loop --------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        t0 = time.perf_counter()
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        trace = self.engine_core.trace
        if trace is not None and core_outputs and trace.records:
            # Detokenizing happens here, after the core's step: add it to its record.
            trace.records[-1].timings["detokenize"] = time.perf_counter() - t0
        if stopped:  # a stop string ended these: free their blocks now
            self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    @property
    def trace(self):
        return self.engine_core.trace

    def shutdown(self) -> None:
        self.engine_core.shutdown()
