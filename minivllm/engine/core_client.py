"""The API side's handle on the engine core: send requests, receive outputs.

The core runs ``run_engine_core`` (see ``minivllm/core/engine_core_proc.py``) either in its own
process (the server's default) or in a thread of this process
(``--inprocess``, for debugging: one process, one debugger). Both talk over
the same ``multiprocessing`` pipe, so the client code is the same for both.

Sending is a plain ``conn.send``: messages are small (token IDs) and the
core drains its end of the pipe every step. Receiving is event-driven: the
pipe's file descriptor is registered with the asyncio loop, and each message
lands in a queue that ``get_output()`` awaits.

If the core dies, its end of the pipe closes; the next read sees EOF and
the client turns into a "dead" state in which every call raises
``EngineDeadError`` at once. Nothing waits forever on a dead engine.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from typing import Iterable, Optional, Union

from minivllm.config import EngineConfig
from minivllm.engine.core_builder import build_engine_core
from minivllm.core.engine_core_proc import (AddRequests, EngineCoreOutputs, EngineCoreReady,
                                            FinishRequests, Shutdown, UtilityCall,
                                            run_engine_core)
from minivllm.core.request import Request, RequestStatus


class EngineDeadError(RuntimeError):
    """The engine core stopped (it crashed or was killed): requests cannot run."""

    def __init__(self, message: str = "the engine core is not running") -> None:
        super().__init__(message)


class EngineCoreClient:
    def __init__(self, config: EngineConfig, in_process: bool = False) -> None:
        self.in_process = in_process
        self.conn, core_end = multiprocessing.Pipe(duplex=True)
        if in_process:
            self.worker: Union[threading.Thread, multiprocessing.process.BaseProcess] = \
                threading.Thread(target=run_engine_core,
                                 args=(config, core_end, build_engine_core, True),
                                 name="EngineCore", daemon=True)
        else:
            # spawn, not fork: this process may already run threads (tokenizers,
            # torch), and forking a threaded process can deadlock the child.
            ctx = multiprocessing.get_context("spawn")
            self.worker = ctx.Process(target=run_engine_core,
                                      args=(config, core_end, build_engine_core),
                                      name="EngineCore")
        self.worker.start()
        if not in_process:
            # The child has its own copy now; ours must close, or the pipe
            # would never read as closed when the child dies.
            core_end.close()
        self.dead = False
        self.dead_reason = ""
        self._outputs: Optional[asyncio.Queue] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        try:
            self.ready = self._wait_until_ready()
        except BaseException:  # a failed start, or Ctrl-C while the model loads
            self.shutdown()
            raise

    # -- start-up ------------------------------------------------------------
    def _wait_until_ready(self) -> EngineCoreReady:
        """Block until the core has loaded the model (or failed to)."""
        try:
            while not self.conn.poll(0.5):
                if not self.worker.is_alive():
                    raise EOFError
            message = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError("the engine core failed to start; its error is printed "
                               "above") from None
        if not isinstance(message, EngineCoreReady):
            raise RuntimeError(f"engine core sent {message!r} instead of its ready message")
        return message

    @property
    def pid(self) -> Optional[int]:
        """The engine-core process id (None with ``--inprocess``)."""
        return None if self.in_process else self.worker.pid

    def start(self) -> None:
        """Start receiving outputs; call from inside the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        if self.dead:
            self._outputs.put_nowait(EngineDeadError(self.dead_reason))
            return
        self._loop.add_reader(self.conn.fileno(), self._on_readable)

    # -- receiving -------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            while self.conn.poll():  # take every message that has arrived
                self._outputs.put_nowait(self.conn.recv())
        except (EOFError, OSError):
            self._mark_dead()

    def _mark_dead(self, reason: Optional[str] = None) -> None:
        if self.dead:
            return
        self.dead = True
        if reason is None:
            code = None if self.in_process else self.worker.exitcode
            reason = ("the engine core stopped" +
                      (f" (exit code {code})" if code is not None else ""))
        self.dead_reason = reason
        if self._loop is not None:
            self._loop.remove_reader(self.conn.fileno())
        if self._outputs is not None:
            self._outputs.put_nowait(EngineDeadError(reason))

    async def get_output(self) -> EngineCoreOutputs:
        if self._outputs is None:
            raise RuntimeError("call start() inside the event loop before get_output()")
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put_nowait(item)  # every later caller fails too
            raise item
        return item

    # -- sending ---------------------------------------------------------------
    def _send(self, message) -> None:
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        try:
            self.conn.send(message)
        except OSError:
            self._mark_dead()
            raise EngineDeadError(self.dead_reason) from None

    def add_requests(self, requests: list[Request]) -> None:
        self._send(AddRequests(list(requests)))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._send(FinishRequests(list(request_ids), RequestStatus.FINISHED_ABORTED))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        self._send(FinishRequests(list(request_ids), status))

    def call_utility(self, call: UtilityCall) -> None:
        """Send a call of the RL API; its ``UtilityOutput`` comes with the outputs."""
        self._send(call)

    # -- shutting down ---------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the core: ask politely, then terminate, then kill. Never hangs."""
        if not self.dead:
            try:
                self.conn.send(Shutdown())
            except OSError:
                pass
        self._mark_dead("the engine core was shut down")
        self.worker.join(timeout)
        if not self.in_process and self.worker.is_alive():
            self.worker.terminate()
            self.worker.join(timeout)
            if self.worker.is_alive():
                self.worker.kill()
                self.worker.join()
        self.conn.close()
