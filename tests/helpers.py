"""Processes the tests start, and the checks that none of them is left behind.

``ServerProcess`` runs ``minivllm serve`` in a subprocess; ``worker_processes``
finds the tensor-parallel workers an engine started (live or orphaned).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from minivllm.entrypoints import launch
from minivllm.entrypoints.launch import free_port  # noqa: F401 (the tests' import)

REPO = Path(__file__).resolve().parents[1]
WORKER_MARK = "minivllm.worker.tp_worker"


def metric_samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels without model_name): value} from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


class ServerProcess(launch.ServerProcess):
    """``minivllm serve`` (minivllm.entrypoints.launch) waited for at start, with an
    HTTP client; its log lives in the test's tmp folder, and failures fail the test."""

    def __init__(self, tmp: Path, *args: str) -> None:
        import httpx

        # One torch thread: the test process runs an engine of its own, and two
        # processes that each spin threads on every core slow each other tenfold.
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        super().__init__(*args, log_path=tmp / "server.log", env=env, cwd=REPO)
        self.http = httpx.Client(base_url=self.url, timeout=120)
        try:
            self.wait_until_healthy()
        except RuntimeError as e:
            self.stop()
            pytest.fail(str(e))

    def stats(self) -> dict:
        return self.http.get("/stats").json()

    def metrics(self) -> dict:
        return metric_samples(self.http.get("/metrics").text)

    def stop(self, timeout_s: float = 60.0):
        if getattr(self, "http", None) is not None:  # (set once the process started)
            self.http.close()
        return super().stop(timeout_s)


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


# Two OpenAI tools with small, closed parameter schemas (the tool-call tests share them).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}}}


def dequantized_copy(folder, out):
    """A float checkpoint holding exactly what quantization='q8_0' computes with:
    every linear weight quantized to Q8_0 and back."""
    from safetensors.torch import load_file, save_file

    from minivllm.model.layers.quantization.ggml_types import dequantize
    from minivllm.model.layers.quantization.q8_0 import quantize_q8_0

    out.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("proj.weight"):
            tensors[name] = dequantize(quantize_q8_0(t), "Q8_0").reshape(t.shape)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in folder.iterdir():
        if f.suffix == ".json":
            (out / f.name).write_text(f.read_text())
    return out


def serve_tiny(tmp_path_factory, model, folder: str, num_kv_blocks: int = 256):
    """A test module's ``minivllm serve --inprocess`` of ``model`` named "tiny", stopped
    after the module: ``yield from serve_tiny(...)`` in a module fixture."""
    srv = ServerProcess(tmp_path_factory.mktemp(folder), model, "--inprocess",
                        "--served-model-name", "tiny", "--num-kv-blocks", str(num_kv_blocks))
    try:
        yield srv
    finally:
        srv.stop()
