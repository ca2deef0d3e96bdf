"""``AsyncLLM``: the engine for an asyncio server, one async stream per request.

    generate(prompt) ──tokenize──▶ EngineCoreClient ──pipe──▶ engine core (process)
          ▲                                                      │
          └── per-request queue ◀── output handler task ◀────────┘
                                    (OutputProcessor: text, stop strings, metrics)

The API process does the string work (chat template, tokenizer, incremental
detokenizer, stop strings); the engine core sees token IDs only. One
background task, the output handler, receives each iteration's
``EngineCoreOutputs``, turns them into ``RequestOutput``s and puts each into
the queue of the request it belongs to; ``generate`` just awaits its queue.

A request is aborted (in the core too, so its KV blocks are freed) when its
consumer stops iterating early: a client that disconnects cancels the task
that iterates ``generate``, and the ``finally`` below does the rest.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import traceback
from typing import AsyncIterator, Optional

from minivllm.config import EngineArgs, EngineConfig
from minivllm.engine.core_client import EngineCoreClient, EngineDeadError
from minivllm.core.engine_core_proc import EngineCoreOutputs, UtilityCall, UtilityOutput
from minivllm.engine.output_processor import OutputProcessor
from minivllm.core.request import RequestStatus
from minivllm.core.scheduler_stats import SchedulerStats
from minivllm.inputs import InputProcessor, InvalidRequestError, PromptType
from minivllm.model.resolve import resolve_engine_config
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class AsyncLLM:
    def __init__(self, config: EngineConfig, in_process: bool = False,
                 stat_logger=None) -> None:
        self.config = config
        # The core starts first: it loads the model in its own process while
        # this one loads the tokenizer.
        self.engine_core = EngineCoreClient(config, in_process=in_process)
        try:
            self.input_processor = InputProcessor(config)
        except BaseException:
            self.engine_core.shutdown()
            raise
        self.tokenizer = self.input_processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_logger = stat_logger  # e.g. a PrometheusStatLogger, or None
        self.scheduler_stats: Optional[SchedulerStats] = None  # latest snapshot
        self.queues: dict[str, asyncio.Queue] = {}
        self.errored: Optional[BaseException] = None
        self._output_handler: Optional[asyncio.Task] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # set by start()
        self._shut_down = False
        self._calls: dict[int, asyncio.Future] = {}  # call_utility's, by call id
        self._call_ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, in_process: bool = False,
                         stat_logger=None) -> "AsyncLLM":
        return cls(resolve_engine_config(args), in_process, stat_logger)

    # -- state -------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.errored is None and not self.engine_core.dead

    @property
    def num_blocks(self) -> int:
        return self.engine_core.ready.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def _check_running(self) -> None:
        if self.errored is not None:
            raise EngineDeadError(f"the engine stopped: {self.errored}")
        if self.engine_core.dead:
            raise EngineDeadError(self.engine_core.dead_reason)

    def start(self) -> None:
        """Start the output handler; needs a running event loop (idempotent)."""
        if self._output_handler is None:
            self.loop = asyncio.get_running_loop()
            self.engine_core.start()
            self._output_handler = self.loop.create_task(
                self._run_output_handler(), name="minivllm-output-handler")

    # -- requests ------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (of ``sampling_params.output_kind``) as they come.

        Bad input (too long, bad token IDs, a chat template error) raises
        ``InvalidRequestError`` (its ``param`` names the field) before anything
        is queued; a dead engine raises ``EngineDeadError``.
        """
        self.start()
        queue = self._add_request(prompt, sampling_params, request_id, priority, lora_request)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self.queues.pop(request_id, None)
            if not finished:  # cancelled, or the consumer stopped early
                self.abort(request_id)

    def _add_request(self, prompt: PromptType, params: SamplingParams,
                     request_id: str, priority: int = 0, lora_request=None) -> asyncio.Queue:
        self._check_running()
        if request_id in self.queues:
            raise InvalidRequestError(f"request_id={request_id!r} is already in use",
                                      "request_id")
        request = self.input_processor.process_inputs(request_id, prompt, params,
                                                      time.monotonic(), priority, lora_request)
        requests = self.output_processor.add_request(request)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        try:
            self.engine_core.add_requests(requests)
        except EngineDeadError:
            self.queues.pop(request_id, None)
            self.output_processor.abort_request(request_id)
            raise
        return queue

    def abort(self, request_id: str) -> None:
        """Stop a request here and in the core (its KV blocks are freed)."""
        child_ids = self.output_processor.child_ids(request_id)
        if not child_ids:
            return  # finished or unknown
        last = self.output_processor.abort_request(request_id)
        if last is not None:
            self._record_finished(last)
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(last)  # an external abort ends the stream, too
        try:
            self.engine_core.abort_requests(child_ids)
        except EngineDeadError:
            pass  # nothing left to free

    def abort_all(self) -> None:
        """Abort every request: each stream ends with a last output ("abort")."""
        for request_id in list(self.queues):
            self.abort(request_id)

    async def call_utility(self, method: str, *args, **kwargs):
        """Run ``LLM.<method>`` of the RL API (``core/rollout.py``) on the engine core,
        between steps; its error is raised here (the server's dev-mode routes)."""
        self.start()
        self._check_running()
        call_id = next(self._call_ids)
        future = self._calls[call_id] = self.loop.create_future()
        try:
            self.engine_core.call_utility(UtilityCall(call_id, method, args, kwargs))
            return await future
        finally:
            self._calls.pop(call_id, None)

    # -- the output handler -----------------------------------------------------------
    async def _run_output_handler(self) -> None:
        try:
            while True:
                item = await self.engine_core.get_output()
                if isinstance(item, UtilityOutput):
                    self._resolve(item)
                else:
                    self._process(item)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:  # a bug here must fail requests, not hang them
            traceback.print_exc()
            self.errored = e
            self._fail_all(EngineDeadError(f"the output handler failed: {e!r}"))

    def _process(self, batch: EngineCoreOutputs) -> None:
        for child_id, error in batch.rejected.items():
            self._reject(child_id, error)
        outputs, stopped = self.output_processor.process_outputs(batch.outputs)
        if stopped:  # a stop string matched: the core can free those requests now
            self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if batch.scheduler_stats is not None:
            self.scheduler_stats = batch.scheduler_stats
        if self.stat_logger is not None:
            if batch.scheduler_stats is not None:
                self.stat_logger.record_scheduler_stats(batch.scheduler_stats)
            self.stat_logger.record_generation_tokens(
                sum(len(o.new_token_ids) for o in batch.outputs))
        for out in outputs:
            if out.finished:
                self._record_finished(out)
            queue = self.queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _resolve(self, out: UtilityOutput) -> None:
        future = self._calls.get(out.call_id)
        if future is not None and not future.done():
            if out.error is not None:
                future.set_exception(out.error)
            else:
                future.set_result(out.result)

    def _reject(self, child_id: str, error: ValueError) -> None:
        parent_id = self.output_processor.parent_id(child_id)
        if parent_id is None:
            return
        siblings = [c for c in self.output_processor.child_ids(parent_id) if c != child_id]
        self.output_processor.abort_request(parent_id)
        if siblings:  # n > 1: the others were accepted but are useless alone
            try:
                self.engine_core.abort_requests(siblings)
            except EngineDeadError:
                pass
        queue = self.queues.get(parent_id)
        if queue is not None:
            queue.put_nowait(error)

    def _record_finished(self, out: RequestOutput) -> None:
        if self.stat_logger is not None and out.metrics is not None:
            self.stat_logger.record_finished_request(out.metrics,
                                                     out.outputs[0].finish_reason or "abort")

    def _fail_all(self, error: BaseException) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        for request_id, queue in list(self.queues.items()):
            self.output_processor.abort_request(request_id)
            queue.put_nowait(error)

    # -- shutting down -------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine core; idempotent (the server calls it on two paths)."""
        if self._shut_down:
            return
        self._shut_down = True
        if self._output_handler is not None:
            self._output_handler.cancel()
        self.engine_core.shutdown()
        self._fail_all(EngineDeadError("the engine was shut down"))
