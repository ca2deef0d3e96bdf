"""Issue 55 on the server: vLLM's dev-mode routes (``MINIVLLM_SERVER_DEV_MODE=1``)
are absent (404) without the switch; with it a trainer sleeps and wakes the
engine (a request in between gets 503, then the same tokens as before), pauses
and resumes it (a request sent while paused waits, then gets its answer), and
sends new weights from its own process over gloo: a bad update is refused
naming the weight (400), the engine unchanged; a good one makes the server
answer as Hugging Face does with the new weights. No process or socket is left.
"""

from __future__ import annotations

import json
import os
import threading

import psutil
import pytest
import torch

from tests.helpers import ServerProcess, alive, free_port
from tests.lora_helpers import greedy
from tests.test_rollout_weights import MAX_TOKENS, hf_model, perturbed

pytestmark = pytest.mark.slow  # starts servers
PROMPTS = [[9, 318, 2007, 44, 1790, 12], [5, 66, 707, 3000, 12000, 41, 41, 8]]
DEV_ROUTES = [("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping"),
              ("post", "/pause"), ("post", "/resume"), ("post", "/reset_prefix_cache"),
              ("post", "/collective_rpc"), ("post", "/init_weight_transfer_engine"),
              ("post", "/update_weights"), ("post", "/finish_weight_update")]


def serve(tmp, folder, dev_mode: bool) -> ServerProcess:
    old = os.environ.pop("MINIVLLM_SERVER_DEV_MODE", None)
    if dev_mode:
        os.environ["MINIVLLM_SERVER_DEV_MODE"] = "1"
    try:
        return ServerProcess(tmp, folder, "--inprocess", "--no-cpu-kernels",
                             "--served-model-name", "tiny",
                             "--num-kv-blocks", "64", "--enable-sleep-mode",
                             "--weight-transfer-config", json.dumps({"backend": "gloo"}))
    finally:
        os.environ.pop("MINIVLLM_SERVER_DEV_MODE", None)
        if old is not None:
            os.environ["MINIVLLM_SERVER_DEV_MODE"] = old


def complete(srv: ServerProcess):
    """The greedy texts of PROMPTS, or the error response."""
    r = srv.http.post("/v1/completions", json={
        "model": "tiny", "prompt": PROMPTS, "temperature": 0,
        "max_tokens": MAX_TOKENS, "ignore_eos": True})
    return [c["text"] for c in r.json()["choices"]] if r.status_code == 200 else r


def hf_texts(model, tokenizer) -> list[str]:
    return [tokenizer.decode(greedy(model, p, MAX_TOKENS)) for p in PROMPTS]


def test_dev_routes_are_off_by_default(tiny_chat_model, tmp_path):
    srv = serve(tmp_path, tiny_chat_model, dev_mode=False)
    try:
        for method, path in DEV_ROUTES:
            assert getattr(srv.http, method)(path).status_code == 404, path
        assert isinstance(complete(srv), list)  # the server itself works
    finally:
        srv.stop()


def test_sleep_pause_and_a_weight_update_from_a_trainer_process(tiny_chat_model, tmp_path):
    from transformers import AutoTokenizer

    from minivllm.distributed.weight_transfer import (trainer_init, trainer_send_weights,
                                                      update_info)

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    old = hf_texts(hf_model(tiny_chat_model), tokenizer)
    trained = perturbed(tiny_chat_model, seed=1)
    new = hf_texts(trained, tokenizer)
    assert new != old  # the update changes the answers: the check below can fail
    info = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2,
            "rank_offset": 1, "timeout_s": 120}
    srv = serve(tmp_path, tiny_chat_model, dev_mode=True)
    http = srv.http
    try:
        assert complete(srv) == old
        # -- sleep: a request gets 503, never an answer; after wake_up the same tokens
        assert http.post("/sleep", params={"level": 1}).json()["freed_bytes"] > 0
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        refused = complete(srv)
        assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"]
        assert http.post("/wake_up").json() == {"is_sleeping": False}
        assert complete(srv) == old
        # -- pause: a request waits for resume
        assert http.post("/pause").json() == {"status": "paused"}
        assert http.get("/is_paused").json() == {"is_paused": True}
        answers: list = []
        waiting = threading.Thread(target=lambda: answers.append(complete(srv)))
        waiting.start()
        waiting.join(2.0)
        assert waiting.is_alive() and not answers  # held, not answered
        assert http.post("/resume").json() == {"status": "resumed"}
        waiting.join(120)
        assert answers == [old]
        # -- the RPC and the cache
        rpc = http.post("/collective_rpc", json={"method": "kv_block_bytes"}).json()
        assert len(rpc["results"]) == 1 and rpc["results"][0] > 0
        assert http.post("/reset_prefix_cache").status_code == 200
        assert http.get("/get_world_size").json() == {"world_size": 1}
        # -- the weight transfer: this process is the trainer
        joined = call_in_thread(http.post, "/init_weight_transfer_engine",
                                json={"init_info": info})
        group = trainer_init(info)
        assert joined.result().status_code == 200
        params = list(trained.named_parameters())
        bad_name = "model.layers.0.mlp.up_projection.weight"
        for bad in ([params[0], (bad_name, torch.zeros(128, 64))],
                    [params[0], ("model.embed_tokens.weight", torch.zeros(5, 64))]):
            assert http.post("/start_weight_update").status_code == 200
            reply = send(http, group, bad, trainer_send_weights, update_info)
            assert reply.status_code == 400
            assert bad[1][0] in reply.json()["error"]["message"]
            assert complete(srv) == old  # the engine unchanged
        assert http.post("/start_weight_update").status_code == 200
        reply = send(http, group, params, trainer_send_weights, update_info)
        assert reply.status_code == 200 and reply.json()["num_weights"] == len(params)
        finish = http.post("/finish_weight_update")
        assert finish.status_code == 200 and finish.json()["updated"]
        assert complete(srv) == new
        del group
    finally:
        pid = srv.pid
        srv.stop()
    assert not alive(pid)
    leftover = [c for c in psutil.Process().net_connections()
                if c.laddr and c.laddr.port == info["master_port"]
                and c.status != psutil.CONN_TIME_WAIT]
    assert leftover == []


class call_in_thread:
    """``fn(*args, **kwargs)`` on a thread; ``result()`` joins it."""

    def __init__(self, fn, *args, **kwargs) -> None:
        self.out: list = []
        self.thread = threading.Thread(target=lambda: self.out.append(fn(*args, **kwargs)))
        self.thread.start()

    def result(self):
        self.thread.join(120)
        return self.out[0]


def send(http, group, weights, trainer_send_weights, update_info):
    """One round: /update_weights announces the tensors while this process sends them."""
    reply = call_in_thread(http.post, "/update_weights",
                           json={"update_info": update_info(weights)})
    trainer_send_weights(weights, group)
    return reply.result()
