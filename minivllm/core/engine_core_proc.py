"""The engine core in its own process: a busy loop around ``EngineCore.step()``.

    API process                              engine-core process
    ───────────                              ───────────────────
    AsyncLLM ──AddRequests / FinishRequests──▶ EngineCoreProc.run_busy_loop()
             ◀────────EngineCoreOutputs──────    (drain messages, step, send)

The two sides talk over one ``multiprocessing`` pipe; every message is a
pickled dataclass. Keeping the core in its own process means the model's
forward pass never blocks the API server's event loop: while the core
computes a step, the API process keeps tokenizing new requests, turning
token IDs into text and streaming it to clients.

The loop blocks on the pipe while there is nothing to do, so an idle engine
uses no CPU. Its outputs go out through a queue and a thread of their own (as
vLLM's output thread): a pipe holds only so many bytes, and a loop blocked
sending outputs while the API side is blocked sending it 2,048 requests would
wait on each other forever; the loop keeps reading instead. It ends on a ``Shutdown`` message, or when the pipe closes (the
API process died): an engine core is never left running on its own.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional
from multiprocessing.connection import Connection

from minivllm.config import EngineConfig
from minivllm.core.engine_core import EngineCore
from minivllm.core.outputs import EngineCoreOutput
from minivllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from minivllm.core.scheduler_stats import SchedulerStats


# -- messages: API side -> engine core ------------------------------------------
@dataclass
class AddRequests:
    requests: list[Request]


@dataclass
class FinishRequests:
    """Abort (the client went away) or stop (a stop string matched) requests."""

    request_ids: list[str]
    status: RequestStatus


@dataclass
class Shutdown:
    pass


@dataclass
class UtilityCall:
    """A call of the RL API (``core/rollout.py``'s ``LLM_API``: sleep, a weight
    update, ...) between steps; the server's dev-mode routes send these."""

    call_id: int
    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


# -- messages: engine core -> API side ---------------------------------------------
@dataclass
class EngineCoreOutputs:
    """Everything one iteration of the engine-core loop sends to the API side.

    One message per iteration (not per request), so a busy step costs one
    round of pickling; the scheduler's stats ride along for ``/metrics``.
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: Optional[SchedulerStats] = None
    # request_id -> why the core refused to add it (e.g. it can never fit in
    # the KV cache: an InvalidRequestError); the API side fails the request with it.
    rejected: dict[str, ValueError] = field(default_factory=dict)


@dataclass
class UtilityOutput:
    """A ``UtilityCall``'s result, or the error it raised."""

    call_id: int
    result: Any = None
    error: Optional[BaseException] = None


@dataclass
class EngineCoreReady:
    """The first message: the model is loaded and the KV cache allocated."""

    pid: int
    num_blocks: int
    block_size: int
    max_model_len: int


class EngineCoreProc:
    def __init__(self, config: EngineConfig, conn: Connection,
                 build: Callable[[EngineConfig], EngineCore]) -> None:
        self.engine_core = build(config)
        self.conn = conn
        self.output_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.output_thread = threading.Thread(target=self._send_outputs, daemon=True,
                                              name="EngineCoreOutputs")

    def _send_outputs(self) -> None:
        """The only sender on the pipe: one message at a time, until ``None``."""
        try:
            while (message := self.output_queue.get()) is not None:
                self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the API side is gone; the loop sees it on its next recv

    def stop_sending(self) -> None:
        """Let the queued outputs go out (the last ones say why the engine ends)."""
        if self.output_thread.is_alive():
            self.output_queue.put(None)
            self.output_thread.join(timeout=10)

    def ready_message(self) -> EngineCoreReady:
        core = self.engine_core
        return EngineCoreReady(pid=os.getpid(), num_blocks=core.num_blocks,
                               block_size=core.config.cache.block_size,
                               max_model_len=core.config.scheduler.max_model_len)

    def run_busy_loop(self) -> None:
        self.output_queue.put(self.ready_message())
        self.output_thread.start()
        while True:
            rejected: dict[str, ValueError] = {}
            # Idle: sleep until a message comes. Busy: take only what is
            # already there, so a step is never delayed by waiting. Paused or
            # asleep (core/rollout.py) is idle: requests wait for resume/wake_up.
            held = self.engine_core.hold is not None
            block = held or not self.engine_core.has_unfinished_requests()
            while block or self.conn.poll():
                message = self.conn.recv()
                block = False
                if isinstance(message, Shutdown):
                    return
                self._handle(message, rejected)
            outputs = (self.engine_core.step() if self.engine_core.hold is None
                       and self.engine_core.has_unfinished_requests() else [])
            # Sent even when the step produced no token (a prefill chunk, an
            # abort while idle): the stats changed and /metrics should say so.
            self.output_queue.put(EngineCoreOutputs(outputs, self.engine_core.make_stats(),
                                                    rejected))

    def _handle(self, message, rejected: dict[str, ValueError]) -> None:
        if isinstance(message, AddRequests):
            for request in message.requests:
                if self.engine_core.hold is not None and self._sleeping(request, rejected):
                    continue
                try:
                    self.engine_core.add_request(request)
                except ValueError as e:  # a bad request must not end the engine
                    rejected[request.request_id] = e
        elif isinstance(message, FinishRequests):
            self.engine_core.finish_requests(message.request_ids, message.status)
        elif isinstance(message, UtilityCall):
            self.output_queue.put(self._call(message))
        else:
            raise TypeError(f"engine core got an unknown message {message!r}")


    def _sleeping(self, request: Request, rejected: dict) -> bool:
        """Refuse ``request`` if the engine sleeps (a paused one keeps it waiting)."""
        from minivllm.core.rollout import EngineSleepingError, sleeping_reason

        reason = sleeping_reason(self.engine_core)
        if reason is not None:
            rejected[request.request_id] = EngineSleepingError(reason)
        return reason is not None

    def _call(self, call: UtilityCall) -> UtilityOutput:
        from minivllm.core.rollout import call_utility

        try:
            return UtilityOutput(call.call_id, call_utility(self.engine_core, call.method,
                                                            call.args, call.kwargs))
        except Exception as e:  # refused, or failed (a trainer never came): the engine goes on
            return UtilityOutput(call.call_id, error=e)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)  # unwinds through `finally`, so the executor shuts down


def run_engine_core(config: EngineConfig, conn: Connection,
                    build: Callable[[EngineConfig], EngineCore],
                    in_thread: bool = False) -> None:
    """Entry point of the engine-core process (or thread, with ``--inprocess``);
    ``build`` makes the core with its executor (``minivllm.engine.core_builder``)."""
    if not in_thread:
        # Ctrl-C reaches every process of the terminal's group; the API
        # process decides when the engine stops, so the engine ignores it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    proc = None
    try:
        proc = EngineCoreProc(config, conn, build)
        proc.run_busy_loop()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the API side is gone: nobody is left to serve
    except SystemExit:
        pass  # SIGTERM: a normal way to end
    except BaseException as e:
        print(f"minivllm engine core failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise
    finally:
        if proc is not None:
            proc.stop_sending()
            proc.engine_core.shutdown()
        # Closing our end is how the API side learns that we are gone.
        conn.close()
