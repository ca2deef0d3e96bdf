"""The scheduler of the async loop (vLLM's ``AsyncScheduler``): step N+1 is decided
while step N still computes.

The synchronous loop advances a request only when its step's token is back. Here
``schedule`` advances ``num_computed_tokens`` at once and counts the token the step
will sample as an *output placeholder* (``request.num_output_placeholders``): the
next ``schedule`` already gives a decoding request its next position, whose input
token the model runner fills in from the previous step's sampled ids (it keeps them;
the core does not have them yet). ``update_from_output`` then turns one placeholder
into a real token per step, in step order.

What falls out of running one step ahead:

* a request that finishes (EOS, stop token, ``max_tokens``, a stop string or an abort
  from outside) already has its next step in flight: that step computes one token
  too many, which ``update_from_output`` drops (the request is finished); its blocks
  were freed at the finish, and the step writes into them before any later step,
  which runs after it, can reuse them;
* a preempted request may still receive the token of its step in flight: it is
  appended (it was computed from valid K/V) and the recompute includes it;
* a request whose sampling reads its own output history (penalties, ``min_tokens``,
  bad words, a grammar) or that asks for pooling is not scheduled while it has a step
  in flight: its sampler must see the previous token. It runs every other step;
  every other request keeps the overlap.

Switched on by ``async_scheduling=True`` (``LLM``, ``EngineArgs``, ``serve
--async-scheduling``). ``None``, the default, is off: vLLM resolves it to on (unless
pipeline parallel, a speculation method it does not run async, or another executor),
for a GPU whose host has cores to spare. On the CPU the forward uses every core, and the
core's Python, run meanwhile, takes one from it: measured on two cores, async gains
nothing at one stream and loses a few per cent at 32 and 128 (figures/records/
benchmarks.md, "Async scheduling on two cores"). Where it cannot
run (``sync_reason``) the engine says so in one log line and runs synchronously.
``BatchQueue`` is the engine core's side (vLLM's ``step_with_batch_queue``);
``worker/async_step.py`` the runner's.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

from minivllm.core.outputs import EngineCoreOutput
from minivllm.core.request import Request
from minivllm.core.sched_output import SchedulerOutput
from minivllm.core.scheduler import SampledTokens, Scheduler


class AsyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # step -> ids of the requests that step samples for (its placeholders).
        self._sampling: dict[int, list[str]] = {}

    def schedule(self) -> SchedulerOutput:
        # Requests that must see their last token before the next step sit this one out.
        held = [r for r in self.running if r.num_output_placeholders and needs_history(r)]
        before = self.running
        if held:
            self.running = [r for r in before if r not in held]
        self._awaiting_output = False  # one step may be in flight: that is the point
        try:
            out = super().schedule()
        finally:
            if held:  # back in their places; the newly admitted stay last
                kept = set(map(id, self.running + held))
                self.running = ([r for r in before if id(r) in kept]
                                + [r for r in self.running if r not in before])
        sampling = []
        for request in out.scheduled_requests:
            request.num_computed_tokens += out.num_scheduled_tokens[request.request_id]
            if request.num_computed_tokens == (request.num_tokens
                                               + request.num_output_placeholders):
                request.num_output_placeholders += 1
                sampling.append(request.request_id)
        self._sampling[out.step] = sampling
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled: SampledTokens,
                           verified: Optional[dict[str, list]] = None,
                           kv_connector_output=None) -> list[EngineCoreOutput]:
        """Turn the step's placeholders into tokens; a finished request's is dropped."""
        sampling = self._sampling.pop(scheduler_output.step, [])
        by_id = {r.request_id: r for r in scheduler_output.scheduled_requests}
        outputs = []
        for rid in sampling:
            request = by_id[rid]
            request.num_output_placeholders -= 1
            if request.is_finished():
                continue  # the token one step too many: never emitted
            if rid not in sampled:
                raise ValueError(f"request {rid!r} reached the end of its tokens in step "
                                 f"{scheduler_output.step} but no token was sampled for it")
            outputs.append(self.append_tokens(request, [sampled[rid]]))
        return outputs


class BatchQueue:
    """The engine core's steps in flight, oldest last (vLLM's ``batch_queue``)."""

    def __init__(self, core) -> None:
        self.core = core
        self.queue: deque = deque()  # (scheduler output, future, clock, t0, t1)

    def __len__(self) -> int:
        return len(self.queue)

    def step(self) -> list[EngineCoreOutput]:
        """vLLM's ``step_with_batch_queue``: schedule step N+1 and hand it over, *then*
        wait for step N and apply it. N+2 is decided only after N's tokens are in."""
        core, queue = self.core, self.queue
        if core.scheduler.has_unfinished_requests():
            t0, start = time.perf_counter(), core.clock.now()
            so = core.scheduler.schedule()
            t1 = time.perf_counter()
            if not so.is_empty:
                queue.appendleft((so, self._guard(core.executor.execute_model_async, so),
                                  start, t0, t1))
                if len(queue) == 1:
                    return []  # the first step: nothing to apply yet
        outputs = self._collect() if queue else []
        if queue and not core.scheduler.has_unfinished_requests():
            # Everyone finished: the step in flight only computes tokens to drop.
            outputs += self._collect()  # wait for it: nothing runs while idle
        return outputs

    def _collect(self) -> list[EngineCoreOutput]:
        """Wait for the oldest step in flight and apply it."""
        so, future, start, t0, t1 = self.queue.pop()
        result = self._guard(future.result)
        return self.core.apply_step(so, result, start, t0, t1, time.perf_counter())

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except BaseException as e:  # as in the sync loop: no later step is trustworthy
            self.core.dead_error = e
            raise


def async_parts(core, config, executor) -> tuple[type, Optional[BatchQueue]]:
    """The scheduler class and batch queue of an engine that asked for async
    scheduling: the async ones, or the sync scheduler and one log line saying why."""
    reason = sync_reason(config, executor)
    if reason is None:
        return AsyncScheduler, BatchQueue(core)
    from minivllm.logger import init_logger

    init_logger(__name__).warning("async_scheduling is off: %s", reason)
    return Scheduler, None


def sync_reason(config, executor) -> Optional[str]:
    """Why an engine asked for async scheduling runs the synchronous loop, or None.

    vLLM's rule: not with pipeline parallelism (minivllm has none), not with a
    speculation method it does not run async, not with an executor other than the
    in-process or multiprocess one. minivllm adds its own, narrower limits: every
    speculation method (n-gram and draft model: the drafts of step N+1 would need
    step N's tokens), tensor parallelism (its executor hands no step over early),
    LoRA (adapter slots are planned when a step is prepared), KV connectors, and
    several kinds of attention.
    """
    if config.speculative is not None:
        return f"speculative decoding ({config.speculative.method}) runs synchronously"
    if not hasattr(executor, "execute_model_async"):  # (worker/async_step.py)
        return f"the {type(executor).__name__} cannot hand a step over early"
    if config.lora is not None:
        return "LoRA (enable_lora) runs synchronously"
    if config.kv_transfer is not None:
        return "a KV connector (kv_transfer_config) runs synchronously"
    if config.model.layer_types is not None:
        return "a model with several kinds of attention runs synchronously"
    return None


def needs_history(request: Request) -> bool:
    """Whether the request's next sample depends on its previous token (or is not a
    plain sample at all): such a request never has two steps in flight."""
    p = request.sampling_params
    return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                or p.min_tokens or p.bad_words_token_ids or p.structured_outputs
                or p.extra_args)


__all__ = ["AsyncScheduler", "BatchQueue", "async_parts", "needs_history", "sync_reason"]
