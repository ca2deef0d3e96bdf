"""Processes the tests start, and the checks that none of them is left behind.

``ServerProcess`` runs ``minivllm serve`` in a subprocess; ``worker_processes``
finds the tensor-parallel workers an engine started (live or orphaned).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
WORKER_MARK = "minivllm.worker.distributed"


def metric_samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels without model_name): value} from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``minivllm serve`` on a free localhost port; its output goes to a log file."""

    def __init__(self, tmp: Path, *args: str) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}.log"
        self.log = open(self.log_path, "w")
        # One torch thread: the test process runs an engine of its own, and two
        # processes that each spin threads on every core slow each other tenfold.
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--port",
             str(self.port), "--uvicorn-log-level", "warning", *args],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)  # its own process group: nothing leaks on failure
        self.http = httpx.Client(base_url=self.url, timeout=120)
        self.wait_until_healthy()

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:]

    def wait_until_healthy(self, deadline_s: float = 600) -> None:
        import httpx

        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.http.get("/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pytest.fail(f"server not healthy after {deadline_s} s:\n{self.log_tail()}")

    def stats(self) -> dict:
        return self.http.get("/stats").json()

    def metrics(self) -> dict:
        return metric_samples(self.http.get("/metrics").text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (only after a failure)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.http.close()
        self.log.close()


def wait_for(condition, what: str, deadline_s: float = 120, poll_s: float = 0.2):
    """Poll until ``condition()`` is truthy; fail naming ``what`` (no timing is asserted)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    pytest.fail(f"gave up waiting for {what}")


def worker_processes(parent_pid: int) -> list[psutil.Process]:
    """Live tensor-parallel workers started by the engine in process ``parent_pid``
    (its children, or orphans if it is gone)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if (WORKER_MARK in cmd and f"--parent-pid {parent_pid}" in cmd
                and proc.info["status"] != psutil.STATUS_ZOMBIE):
            found.append(proc)
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
