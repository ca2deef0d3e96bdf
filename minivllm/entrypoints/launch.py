"""``minivllm serve`` as a child process: start it, wait until it answers, stop it.

The book's chapters and the server tests all need a real server next to the
code that talks to it. This starts one on a free localhost port with its
output in a log file, waits for ``/health``, and stops it with SIGTERM (what
Ctrl-C sends: the server shuts its engine core down and exits); a server
that does not exit in time is killed with its whole process group, so no
engine core outlives it. A Python process exiting stops its servers too.

    with ServerProcess("--num-kv-blocks", "64") as server:
        server.wait_until_healthy()
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional


def free_port() -> int:
    """A localhost TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_gone(pid: int, timeout_s: float = 30.0) -> bool:
    """True once no process has id ``pid`` (polled for up to ``timeout_s`` seconds):
    how a caller checks that a server's engine core did not outlive it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            return True
        except PermissionError:  # exists, owned by someone else
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def port_is_free(port: int) -> bool:
    """True if nothing listens on localhost ``port`` now (a stopped server released it)."""
    with socket.socket() as s:
        # SO_REUSEADDR: closed connections may linger in TIME_WAIT; a listener may not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


class ServerProcess:
    """``minivllm serve <args>`` on a free localhost port (see the module docstring)."""

    def __init__(self, *args: str, log_path: Optional[Path] = None,
                 env: Optional[dict] = None, cwd: Optional[Path] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["serve", "--port", str(self.port), "--uvicorn-log-level", "warning",
                     *args]
        self._own_log = log_path is None  # a temporary file: removed by stop()
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="minivllm-serve-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minivllm.entrypoints.cli", *self.args],
            env=dict(os.environ if env is None else env, PYTHONUNBUFFERED="1"), cwd=cwd,
            stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)  # its own process group: stop() can end all of it
        atexit.register(self.stop)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def command(self) -> str:
        """The command line as a user would type it."""
        return " ".join(["minivllm", *self.args])

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path.exists() else ""

    def wait_until_healthy(self, timeout_s: float = 600.0) -> float:
        """Poll ``/health`` until it answers 200; returns the seconds waited.

        Raises RuntimeError, with the end of the server's log, if the server
        exits first or does not answer within ``timeout_s``.
        """
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"minivllm serve exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except OSError:  # not listening yet
                pass
            time.sleep(0.25)
        raise RuntimeError(f"minivllm serve did not answer /health within {timeout_s} s:\n"
                           f"{self.log_tail()}")

    def get_json(self, path: str) -> dict:
        """``GET <path>`` (e.g. ``/stats``) as JSON."""
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def metric(self, name: str, label: str = "") -> float:
        """One series of ``/metrics``: ``minivllm:<name>{...}``, the first whose labels
        contain ``label`` (e.g. ``'finished_reason="abort"'``)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith(f"minivllm:{name}{{") and label in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"metric name={name!r} label={label!r}: no such series in "
                       f"{self.url}/metrics")

    def stop(self, timeout_s: float = 60.0) -> Optional[int]:
        """SIGTERM, then SIGKILL to the process group if it is still there; returns
        the server's exit code (None if it had to be killed). Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.poll()
        try:  # whatever is left of the group (an engine core, after a failure)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if code is None:
            self.proc.wait()
        if not self._log.closed:
            self._log.close()
            if self._own_log:
                self.log_path.unlink(missing_ok=True)
        atexit.unregister(self.stop)
        return code

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["ServerProcess", "free_port", "port_is_free", "process_gone"]
