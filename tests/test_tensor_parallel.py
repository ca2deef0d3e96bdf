"""Issue 7: tensor parallelism. TP=N gives the same tokens as TP=1, its collectives
move the bytes the theory says, and no worker process outlives its engine, even
when a worker dies or the engine is interrupted or killed.

Every TP engine here runs on CPU (gloo). The machine has few cores, so the
models, prompts and token counts are small.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.layers.tp_plan import expected_collective_bytes
from tests.conftest import CHAT_PROMPTS, chat_ids
from tests.helpers import (REPO, WORKER_MARK, ServerProcess, alive, free_port, wait_for,
                           worker_processes)


@pytest.fixture(autouse=True)
def bounded_collectives(monkeypatch):
    # A bug that desynchronises the ranks fails in two minutes, not five.
    monkeypatch.setenv("MINIVLLM_TP_TIMEOUT", "120")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def no_orphans():
    """Every test must leave no worker process and no other child behind."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 15  # a worker told to stop may take a moment
    while time.monotonic() < deadline:
        new_children = [p for p in psutil.Process().children(recursive=True)
                        if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
        if not worker_processes(os.getpid()) and not new_children:
            return
        time.sleep(0.2)
    pytest.fail(f"processes left behind: {worker_processes(os.getpid()) + new_children}")


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def run(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def tokens_with(model, tp: int, prompts, params, **engine_args) -> list[list[int]]:
    llm = LLM(model, tensor_parallel_size=tp, **engine_args)
    try:
        return run(llm, prompts, params)
    finally:
        llm.shutdown()


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Seeded sampling draws from the whole distribution, so it checks more than the argmax.
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)


# -- equality with TP=1 ----------------------------------------------------------

TINY_CASES = [
    # (family, config overrides, tp, engine args): what each one splits
    pytest.param("llama", {}, 2, {"max_num_batched_tokens": 16},
                 id="llama-tp2-kv-split-chunked"),
    pytest.param("qwen2", {}, 4, {}, marks=pytest.mark.slow,
                 id="qwen2-tp4-kv-copied-x2-qkv-bias"),
    pytest.param("llama-untied-llama3-rope", {"num_key_value_heads": 1, "vocab_size": 250},
                 4, {}, marks=pytest.mark.slow,
                 id="llama-tp4-kv-copied-x4-untied-padded-vocab"),
    pytest.param("qwen3", {}, 2, {}, marks=pytest.mark.slow, id="qwen3-tp2-qk-norm"),
]


@pytest.mark.parametrize("family,overrides,tp,engine_args", TINY_CASES)
def test_tiny_model_tp_matches_tp1(tiny_model, family, overrides, tp, engine_args):
    folder = tiny_model(family, **overrides)
    vocab = overrides.get("vocab_size", 256)
    prompts = random_prompts(vocab, [5, 23, 1, 40, 9])
    args = dict(num_kv_blocks=64, **engine_args)
    one = LLM(folder, **args)  # one TP=1 engine for both references
    try:
        ref_greedy, ref_seeded = run(one, prompts, GREEDY), run(one, prompts, SEEDED)
    finally:
        one.shutdown()
    llm = LLM(folder, tensor_parallel_size=tp, **args)
    try:
        assert run(llm, prompts, GREEDY) == ref_greedy
        assert run(llm, prompts, SEEDED) == ref_seeded
    finally:
        llm.shutdown()
    assert len({tuple(t) for t in ref_seeded}) == len(prompts)  # the check had contents


@pytest.mark.slow
def test_default_model_tp3_matches_tp1(default_tokenizer):
    """SmolLM2-135M: 9 query heads and 3 KV heads, one KV head per rank."""
    prompts = [chat_ids(default_tokenizer, p) for p in CHAT_PROMPTS[:8]]
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = tokens_with(None, 1, prompts, params, num_kv_blocks=128)
    llm = LLM(tensor_parallel_size=3, num_kv_blocks=128, trace=True)
    try:
        assert run(llm, prompts, params) == ref
        core = llm.engine_core
        assert core.kv_cache_manager.num_free_blocks == core.num_blocks
        # Each rank's cache holds its own KV head only.
        k_cache, _ = core.executor.runner.kv_caches[0]
        assert k_cache.shape[2] == 1
    finally:
        llm.shutdown()


# -- collective volume -------------------------------------------------------------

def test_measured_collective_bytes_equal_theory(tiny_model):
    folder = tiny_model("llama")
    prompts = random_prompts(256, [40, 23, 5])
    # A token budget of 16 cuts the prompts into chunks: middle chunks score
    # no logits (the first step has only one), so steps differ in T and in S.
    llm = LLM(folder, tensor_parallel_size=2, num_kv_blocks=64, max_num_batched_tokens=16,
              enable_prefix_caching=False, trace=True)
    try:
        run(llm, prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        config = llm.llm_engine.config
        computed = {}
        prompt_len = {str(i): len(p) for i, p in enumerate(prompts)}
        steps_without_logits = 0
        for record in llm.trace:
            # A request scores logits when its step reaches past its prompt.
            rows = 0
            for rid, (n, _) in record.scheduled.items():
                computed[rid] = computed.get(rid, 0) + n
                rows += computed[rid] >= prompt_len[rid]
            steps_without_logits += rows == 0
            assert record.timings["tp_size"] == 2
            assert record.timings["collective_bytes"] == expected_collective_bytes(
                config, record.num_batched_tokens, 2, num_logits_rows=rows)
        assert steps_without_logits > 0
        # While this TP engine lives, no other engine may be built in the process.
        with pytest.raises(RuntimeError, match="tensor-parallel group of 2 ranks"):
            LLM(folder, num_kv_blocks=8)
        with pytest.raises(RuntimeError, match="one tensor-parallel engine per process"):
            LLM(folder, tensor_parallel_size=2, num_kv_blocks=8)
    finally:
        llm.shutdown()


def test_expected_collective_bytes_formula(default_model_path):
    """The documented volume for SmolLM2: 30 layers, hidden 576, vocab 49152, fp32."""
    from minivllm.config import ModelConfig

    cfg = ModelConfig.from_pretrained(default_model_path)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    t, s = 100, 3
    assert expected_collective_bytes(cfg, t, 3, num_logits_rows=s) == \
        61 * t * 576 * 4 + 2 * s * (49152 // 3) * 4
    assert expected_collective_bytes(cfg, t, 1) == 0


# -- sizes that cannot be split --------------------------------------------------------

@pytest.mark.parametrize("overrides,tp,field", [
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, 3, "num_attention_heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}, 2,
     "num_key_value_heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48,
      "intermediate_size": 96}, 3, "num_key_value_heads=2 of the model is fewer"),
    ({"intermediate_size": 130}, 4, "intermediate_size"),
])
def test_indivisible_size_fails_before_spawning(tiny_model, overrides, tp, field):
    folder = tiny_model("llama", **overrides)
    children = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match=f"{field}.*tensor_parallel_size={tp}"):
        LLM(folder, tensor_parallel_size=tp)
    assert psutil.Process().children(recursive=True) == children
    assert not worker_processes(os.getpid())


# -- failures and life cycle -------------------------------------------------------------

@pytest.mark.parametrize("when", ["between-steps", "during-a-step"])
def test_killed_worker_fails_clearly(tiny_model, when):
    folder = tiny_model("llama")
    llm = LLM(folder, tensor_parallel_size=2, num_kv_blocks=64, trace=True)
    worker = llm.engine_core.executor.workers.procs[1]
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    try:
        if when == "between-steps":
            stream = llm.stream({"prompt_token_ids": [5, 6, 7]}, params)
            next(stream), next(stream)
            worker.kill()
            worker.wait()
            with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) was killed by "
                                                   r"signal SIGKILL"):
                for _ in stream:
                    pass
        else:
            def kill_after_some_steps():
                while len(llm.trace) < 3:
                    time.sleep(0.01)
                os.kill(worker.pid, signal.SIGKILL)

            killer = threading.Thread(target=kill_after_some_steps, daemon=True)
            killer.start()
            with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) was killed by "
                                                   r"signal SIGKILL"):
                run(llm, random_prompts(256, [20, 30]), params)
            killer.join()
        # The failure stopped the whole group at once, not at shutdown().
        assert llm.engine_core.executor.workers.closed
        with pytest.raises(RuntimeError, match="workers have been stopped"):
            llm.engine_core.executor.determine_num_blocks()
    finally:
        llm.shutdown()


def test_interrupt_mid_step_stops_the_workers_at_once(tiny_model, monkeypatch):
    """Ctrl-C while the worker waits in a collective of the step: rank 0 must not
    wait for a collective that will never complete, nor ask the worker to stop."""
    folder = tiny_model("llama")
    llm = LLM(folder, tensor_parallel_size=2, num_kv_blocks=64)
    worker = llm.engine_core.executor.workers.procs[1]
    runner = llm.engine_core.executor.runner
    real_forward, calls = runner.forward, []

    def forward_interrupted_at_step_3(inputs):
        calls.append(1)
        if len(calls) == 3:  # the worker got "forward" and is in the first all-reduce
            raise KeyboardInterrupt
        return real_forward(inputs)

    monkeypatch.setattr(runner, "forward", forward_interrupted_at_step_3)
    try:
        with pytest.raises(KeyboardInterrupt):
            run(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=50,
                                                 ignore_eos=True))
        # Already stopped, by the interrupt itself: terminated, not told "stop".
        assert llm.engine_core.executor.workers.closed
        assert worker.poll() == -signal.SIGTERM
        assert not torch.distributed.is_initialized()
    finally:
        llm.shutdown()


def test_shutdown_does_not_wait_for_a_stuck_worker(tiny_model, monkeypatch):
    """A worker that never takes "stop" (here: frozen) is terminated after a deadline."""
    from datetime import timedelta

    from minivllm.worker import tp_executor

    monkeypatch.setattr(tp_executor, "STOP_TIMEOUT", timedelta(seconds=1))
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, num_kv_blocks=64)
    worker = llm.engine_core.executor.workers.procs[1]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        llm.shutdown()  # before the deadline it waited for ever: a gloo broadcast
        # returns on rank 0 only once every rank has taken it
        # Frozen, it does not act on SIGTERM; the SIGKILL that follows ends it.
        assert worker.poll() == -signal.SIGKILL
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


ENGINE_SCRIPT = """
import sys
from minivllm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=64)
print(*[p.pid for p in llm.engine_core.executor.workers.procs.values()], flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)  # no shutdown(): the workers must go all the same
params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
announced = False
while True:
    for i, _ in enumerate(llm.stream({"prompt_token_ids": [5, 6, 7]}, params)):
        if i == 3 and not announced:  # steps are running: a signal now comes mid-generation
            print("generating", flush=True)
            announced = True
"""


def _as_from_a_terminal() -> None:
    """Ctrl-C reaches a program a terminal started with SIGINT at its default. A
    launcher without job control (a CI runner, `cmd &` in a script) starts its
    children with SIGINT ignored, exec keeps it so, and Python then never raises
    KeyboardInterrupt: the engine would generate on, untouched by the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "sigint", "sigkill"])
def test_workers_end_with_the_engine_process(tiny_model, tmp_path, how):
    """Plain exit without shutdown(), Ctrl-C mid-generation, and kill -9 of the engine."""
    folder = tiny_model("llama")
    # stderr goes to a file: a pipe nobody reads could fill up and block the engine.
    with open(tmp_path / "engine.err", "w") as err:
        engine = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, str(folder), how],
                                  stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO,
                                  preexec_fn=_as_from_a_terminal)
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        assert len(pids) == 1, (tmp_path / "engine.err").read_text()
        if how != "exit":
            assert engine.stdout.readline().strip() == "generating"
            engine.send_signal(signal.SIGINT if how == "sigint" else signal.SIGKILL)
        code = engine.wait(timeout=60)
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in pids)
        stderr = (tmp_path / "engine.err").read_text()
        if how == "exit":
            assert code == 0, stderr
        elif how == "sigint":
            assert code != 0 and "KeyboardInterrupt" in stderr, stderr
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


# -- the OpenAI server with tensor parallelism ---------------------------------------

@pytest.mark.slow
def test_server_with_tp_matches_offline_and_ctrl_c_stops_it_all(tmp_path, tiny_chat_model):
    """`minivllm serve --tensor-parallel-size 2`: greedy answers, whole or streamed,
    equal the offline TP=1 engine's; Ctrl-C in the middle of a stream ends the
    server, its engine core and the worker, and the stream still gets [DONE]."""
    import httpx
    from openai import OpenAI

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = "The sky is"
    with LLM(tiny_chat_model, num_kv_blocks=256) as llm:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        ref_chat = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        ref_text = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    srv = ServerProcess(tmp_path, tiny_chat_model, "--tensor-parallel-size", "2",
                        "--served-model-name", "tiny", "--num-kv-blocks", "256")
    try:
        engine_pid = srv.stats()["engine_pid"]
        assert len(worker_processes(engine_pid)) == 1
        processes = psutil.Process(srv.proc.pid).children(recursive=True)
        greedy = dict(model="tiny", temperature=0, max_tokens=24,
                      extra_body={"ignore_eos": True})
        with OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                    timeout=120) as client:
            chat = client.chat.completions.create(messages=messages, **greedy)
            assert chat.choices[0].message.content == ref_chat.text
            assert chat.usage.completion_tokens == len(ref_chat.token_ids)
            chunks = client.chat.completions.create(messages=messages, stream=True, **greedy)
            assert "".join(c.choices[0].delta.content or "" for c in chunks
                           if c.choices) == ref_chat.text
            whole = client.completions.create(prompt=prompt, **greedy)
            assert whole.choices[0].text == ref_text.text
            assert whole.usage.completion_tokens == len(ref_text.token_ids)
            chunks = client.completions.create(prompt=prompt, stream=True, **greedy)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == ref_text.text
        assert len(set(ref_text.token_ids)) > 1  # the comparison had contents

        lines: list[str] = []

        def consume() -> None:  # a stream still open when Ctrl-C comes
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1000,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                              timeout=120) as r:
                lines.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        wait_for(lambda: srv.stats()["num_requests_running"] == 1, "the stream to start")
        # A terminal's Ctrl-C reaches its whole foreground group: server and engine core.
        os.killpg(srv.proc.pid, signal.SIGINT)
        assert srv.proc.wait(60) == 0
        _, left = psutil.wait_procs(processes, timeout=30)
        assert left == [] and not worker_processes(engine_pid), f"left running: {left}"
        reader.join(60)
        assert lines[-1] == "data: [DONE]"
    finally:
        srv.stop()


def test_worker_started_by_hand_joins_the_engine(tiny_model, monkeypatch):
    """The two-host recipe on one host: rank 1 is started by its own command."""
    folder = tiny_model("llama")
    prompts = random_prompts(256, [7, 12])
    ref = tokens_with(folder, 1, prompts, GREEDY, num_kv_blocks=64)
    port = str(free_port())
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=port)
    worker = subprocess.Popen([sys.executable, "-m", WORKER_MARK, "--threads", "1"],
                              env=env, cwd=REPO)
    try:
        for name, value in (("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", port)):
            monkeypatch.setenv(name, value)
        llm = LLM(folder, tensor_parallel_size=2, num_kv_blocks=64)
        try:
            assert llm.engine_core.executor.workers.procs == {}  # nobody spawned here
            assert run(llm, prompts, GREEDY) == ref
        finally:
            llm.shutdown()
        assert worker.wait(timeout=30) == 0  # told to stop, it exits cleanly
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_other_hosts_need_an_address(tiny_model, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        LLM(tiny_model("llama"), tensor_parallel_size=2)


def test_rank_that_cannot_load_fails_the_engine_clearly(tiny_model, monkeypatch):
    """A worker whose model runner fails to build sends its traceback to rank 0."""
    folder = tiny_model("llama")
    port = str(free_port())
    # Only this worker is told to use Triton, which cannot run on CPU uninterpreted.
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=port, MINIVLLM_ATTENTION_BACKEND="triton")
    env.pop("TRITON_INTERPRET", None)
    worker = subprocess.Popen([sys.executable, "-m", WORKER_MARK, "--threads", "1"],
                              env=env, cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        for name, value in (("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", port)):
            monkeypatch.setenv(name, value)
        with pytest.raises(RuntimeError, match=r"rank 1 failed:[\s\S]*MINIVLLM_ATTENTION_"
                                               r"BACKEND='triton' cannot run"):
            LLM(folder, tensor_parallel_size=2, num_kv_blocks=64)
        assert worker.wait(timeout=30) != 0
        assert not torch.distributed.is_initialized()  # rank 0 let go of the group
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
