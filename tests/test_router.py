"""``minivllm router`` in front of real ``minivllm serve`` replicas (tiny models).

What a fleet must do, checked end to end: answers equal one engine's, a
conversation's later turns land where its prefix is cached (kv_aware, from
KV events) and hit that cache; a replica killed mid-stream ends that stream
with an error and the rest go elsewhere; a silent (stopped) replica is taken
out of rotation and its requests move; both come back when they answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, ServerProcess, free_port, metric_samples, wait_for

pytest.importorskip("fastapi")
pytest.importorskip("zmq")

MAX_TOKENS = 8


class RouterProcess:
    def __init__(self, tmp: Path, *args: str) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(tmp / "router.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minivllm.entrypoints.cli", "router", "--port",
             str(self.port), *args], cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        self.http = httpx.Client(base_url=self.url, timeout=120, trust_env=False)

        def up():
            if self.proc.poll() is not None:
                pytest.fail(f"router exited: {(tmp / 'router.log').read_text()[-2000:]}")
            try:
                return self.http.get("/health").status_code == 200
            except httpx.TransportError:
                return False
        wait_for(up, "the router to answer /health", 60)

    def stats(self) -> dict:
        return self.http.get("/stats").json()

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def replica(tmp_path_factory, model: str, *extra: str) -> ServerProcess:
    return ServerProcess(tmp_path_factory.mktemp("replica"), model, "--served-model-name",
                         "tiny", "--num-kv-blocks", "256", *extra)


def chat(router: RouterProcess, messages: list[dict], **kw) -> tuple[dict, str]:
    r = router.http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS,
        "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json(), r.headers["x-minivllm-replica"]


@pytest.mark.slow
def test_kv_aware_router_keeps_conversations_on_their_cache(tmp_path_factory, tiny_chat_model):
    from minivllm import LLM, SamplingParams

    ports = [free_port() for _ in range(2)]
    reps = [replica(tmp_path_factory, tiny_chat_model, "--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{p}"})) for p in ports]
    router = None
    try:
        router = RouterProcess(tmp_path_factory.mktemp("router"), "--policy", "kv_aware",
                               *[a for r in reps for a in ("--replica", r.url)],
                               *[a for p in ports for a in ("--kv-events", f"tcp://127.0.0.1:{p}")])
        system = {"role": "system", "content": "You are a terse assistant. " * 8}
        sessions = [[system] for _ in range(3)]
        seen: list[list[tuple[str, int]]] = [[] for _ in sessions]
        for turn in range(3):
            for s, messages in enumerate(sessions):
                messages.append({"role": "user", "content": f"session {s} turn {turn} hello"})
                body, url = chat(router, messages)
                cached = body["usage"].get("prompt_tokens_details", {}) or {}
                seen[s].append((url, cached.get("cached_tokens", 0)))
                messages.append({"role": "assistant",
                                 "content": body["choices"][0]["message"]["content"]})
        for s in seen:  # later turns follow the first to its replica and hit its cache
            assert {url for url, _ in s} == {s[0][0]}
            assert all(hit > 0 for _, hit in s[1:])
        stats = router.stats()
        assert sum(r["num_routed"] for r in stats["replicas"]) == 9
        # Each request waited for its tokens (a /tokenize round trip) before routing.
        assert len(stats["tokenize_seconds"]) == 9
        assert all(0 < s < 30 for s in stats["tokenize_seconds"])
        # ... asked of the healthy replicas in turn, not always of the first one.
        assert [r["num_tokenized"] for r in stats["replicas"]] == [5, 4]
        assert all(r["num_cached_blocks"] > 0 for r in stats["replicas"]
                   if r["num_routed"]), stats
        m = metric_samples(router.http.get("/metrics").text)
        assert sum(v for (name, _), v in m.items()
                   if name == "minivllm_router_requests_routed_total") == 9

        # Each answer says what its request waited for its tokens (the simulator
        # replays it per request): one of the router's own records.
        r = router.http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": sessions[0][:2], "max_tokens": 1})
        waited = float(r.headers["x-minivllm-tokenize-seconds"])
        assert waited in [round(s, 6) for s in router.stats()["tokenize_seconds"]]

        # Answers equal one engine's.
        with LLM(tiny_chat_model, num_kv_blocks=256) as llm:
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            for messages in sessions:
                for k in range(2, len(messages), 2):
                    ref = llm.chat(messages[:k], params, use_tqdm=False)[0].outputs[0].text
                    assert ref == messages[k]["content"]
    finally:
        if router is not None:
            router.stop()
        for r in reps:
            r.stop()


def restart(tmp_path_factory, monkeypatch, model: str, url: str) -> ServerProcess:
    from minivllm.entrypoints import launch

    with monkeypatch.context() as m:
        m.setattr(launch, "free_port", lambda: int(url.rsplit(":", 1)[1]))
        return replica(tmp_path_factory, model)


@pytest.mark.slow
def test_replicas_that_die_or_stall_leave_and_come_back(tmp_path_factory, monkeypatch,
                                                        tiny_chat_model):
    reps = [replica(tmp_path_factory, tiny_chat_model) for _ in range(2)]
    router = None
    stopped = None
    try:
        router = RouterProcess(tmp_path_factory.mktemp("router"), "--policy", "round_robin",
                               "--health-interval", "0.5", "--health-timeout", "1",
                               *[a for r in reps for a in ("--replica", r.url)])
        msgs = [{"role": "user", "content": "Count to a hundred"}]

        def up():
            return router.http.get("/health").json().get("replicas_up", 0)

        # A stream whose replica is killed mid-way ends with an error, then [DONE].
        events = []
        with router.http.stream("POST", "/v1/chat/completions", json={
                "model": "tiny", "messages": msgs, "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as r:
            victim = next(x for x in reps if x.url == r.headers["x-minivllm-replica"])
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        os.killpg(victim.pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        assert "replica serving this stream failed" in json.loads(events[-2])["error"]["message"]
        wait_for(lambda: up() == 1, "the dead replica to leave the rotation", 30)
        victim.stop()
        survivor = next(x for x in reps if x is not victim)
        for _ in range(4):  # none goes to the dead one
            assert chat(router, msgs)[1] == survivor.url

        reps[reps.index(victim)] = back = restart(tmp_path_factory, monkeypatch,
                                                  tiny_chat_model, victim.url)
        wait_for(lambda: up() == 2, "the restarted replica to come back", 30)
        assert {chat(router, msgs)[1] for _ in range(2)} == {back.url, survivor.url}

        # A replica that stops answering (SIGSTOP): its requests move to the other one.
        os.killpg(survivor.pid, signal.SIGSTOP)
        stopped = survivor
        assert {chat(router, msgs)[1] for _ in range(4)} == {back.url}
        assert up() == 1
        os.killpg(survivor.pid, signal.SIGCONT)
        stopped = None
        wait_for(lambda: up() == 2, "the stalled replica to come back", 30)
        m = metric_samples(router.http.get("/metrics").text)
        fails = {dict(labels)["replica"]: v for (name, labels), v in m.items()
                 if name == "minivllm_router_replica_failures_total"}
        assert fails[survivor.url] >= 1 and fails[victim.url] >= 1
    finally:
        if stopped is not None:
            os.killpg(stopped.pid, signal.SIGCONT)
        if router is not None:
            router.stop()
        for r in reps:
            r.stop()
