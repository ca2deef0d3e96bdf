"""The synchronous engine: input processing + engine core + output processing.

    prompt ──InputProcessor──▶ token IDs ──EngineCore.step()──▶ new token IDs
             (every check)                                         │
            RequestOutput ◀──OutputProcessor───────────────────────┘  (text, stop strings)

``LLM`` drives it in a loop; the server uses the same processors around an
engine core in another process."""

from __future__ import annotations

import itertools
import time
from typing import Optional

from minivllm.config import EngineArgs, EngineConfig
from minivllm.engine.core_builder import build_engine_core
from minivllm.engine.output_processor import OutputProcessor
from minivllm.core.request import RequestStatus
from minivllm.inputs import InputProcessor, PromptType
from minivllm.model.resolve import resolve_engine_config
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.input_processor = InputProcessor(config)
        self.tokenizer = self.input_processor.tokenizer
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
        request = self.input_processor.process_inputs(request_id, prompt, params,
                                                      arrival_time, priority, lora_request)
        core_requests = self.output_processor.add_request(request)
        try:
            for req in core_requests:
                self.engine_core.add_request(req)  # the scheduler: do its KV blocks fit?
        except BaseException:
            self.abort_request(request_id)  # nothing of it stays behind
            raise
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
