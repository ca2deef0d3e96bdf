"""`minivllm bench throughput` and `bench roofline`: the arithmetic behind the
reported numbers, checked against real models and by hand-derivable cases,
and one end-to-end run with two backends in their own processes (slow)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from minivllm.lab.bench import roofline as rl
from minivllm.lab.bench import throughput as tp
from minivllm.lab.bench.workload import CHAT_PROMPTS, chat_workload, random_workload
from minivllm.config import ModelConfig


# -- roofline: the model's side ---------------------------------------------------------

@pytest.mark.parametrize("family,overrides", [
    ("llama", {}), ("llama", {"tie_word_embeddings": False}), ("qwen2", {}),
    ("qwen3", {}), ("mistral", {})])
def test_param_count_matches_transformers(tiny_model, family, overrides):
    from transformers import AutoModelForCausalLM

    folder = tiny_model(family, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    cfg = ModelConfig.from_pretrained(folder)
    assert rl.model_param_count(cfg) == sum(p.numel() for p in hf.parameters())
    # FLOPs: 2 per weight that multiplies (the embedding lookup does not, unless it
    # is also the LM head).
    embed = cfg.vocab_size * cfg.hidden_size
    matmul = rl.model_param_count(cfg) - (0 if cfg.tie_word_embeddings else embed)
    assert rl.flops_per_token(cfg) == 2 * matmul
    assert rl.flops_per_token(cfg, context_len=10) == 2 * matmul + 10 * 4 * (
        cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim)
    assert rl.weight_bytes(cfg, torch.bfloat16) == 2 * rl.model_param_count(cfg)


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_moe_param_count_matches_transformers(tiny_model, family):
    """Every expert counts in the parameters (and the memory), only the k a token
    picks in its FLOPs: all less (E - k) experts per sparse layer."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model(family)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    cfg = ModelConfig.from_pretrained(folder)
    assert rl.model_param_count(cfg) == sum(p.numel() for p in hf.parameters())
    moe, h = cfg.moe, cfg.hidden_size
    idle = len(moe.sparse_layers) * (moe.num_experts - moe.top_k) * 3 * h \
        * moe.intermediate_size
    assert rl.active_param_count(cfg) == rl.model_param_count(cfg) - idle
    embed = cfg.vocab_size * h
    assert rl.flops_per_token(cfg) == 2 * (rl.active_param_count(cfg)
                                           - (0 if cfg.tie_word_embeddings else embed))
    assert rl.weight_bytes(cfg, torch.bfloat16) == 2 * rl.model_param_count(cfg)


def test_moe_roofline_reads_the_active_experts_derived_by_hand(tiny_model):
    """The tiny Qwen3-MoE (conftest): hidden 64, 4 query heads and 2 KV heads of 16,
    q/k norms, vocabulary 256 tied; layer 0 a dense MLP of 128, layer 1 8 experts of
    32 with top-2. A one-token step reads its active weights; a step of T tokens
    the experts they touch, 8 (1 - (6/8)^T) on average; the roofline column uses it."""
    cfg = ModelConfig.from_pretrained(tiny_model("qwen3-moe"))
    attention = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 16 + 2 * 64  # q k v o, q/k norms, 2 norms
    expert = 3 * 64 * 32
    active = (2 * attention + 3 * 64 * 128  # layer 0's dense MLP
              + 64 * 8 + 2 * expert  # layer 1: router, 2 experts
              + 256 * 64 + 64)  # embedding (the head too), final norm
    assert rl.active_param_count(cfg) == active == 78720
    assert rl.model_param_count(cfg) == active + 6 * expert
    assert rl.step_weight_bytes(cfg, 1, torch.float32) == 4 * active
    touched = 8 * (1 - (6 / 8) ** 3)  # 4.625 experts of 8 for 3 tokens
    assert rl.step_weight_bytes(cfg, 3, torch.float32) == pytest.approx(
        4 * (active + (touched - 2) * expert))
    assert rl.step_weight_bytes(cfg, 10_000, torch.float32) == pytest.approx(
        rl.weight_bytes(cfg, torch.float32))  # a large batch reads every expert

    fields = rl.moe_roofline_fields(cfg, torch.float32)
    assert fields == {"expert_bytes": 4 * expert, "num_experts": 8, "top_k": 2}
    roof = rl.Roofline("float32", 1e12, 1e9, 1e9, 1e9, rl.model_param_count(cfg),
                       rl.flops_per_token(cfg), rl.step_weight_bytes(cfg, 1, torch.float32),
                       **fields)
    assert roof.weight_bytes == 4 * active  # the one-stream column: active bytes
    assert roof.step_bytes(3) == pytest.approx(4 * (active + (touched - 2) * expert))
    assert roof.ceiling_tokens_per_s(3) == pytest.approx(3 * 1e9 / roof.step_bytes(3))
    # bench throughput's column: 3 tokens a step over 10 steps, at 1 GB/s, in 1 s.
    # The engine's own weight bytes (every expert it holds) do not count for an MoE.
    fraction = tp.roofline_fraction(roof.as_dict(), num_tokens=30, num_steps=10,
                                    seconds=1.0, weight_bytes=4 * (active + 6 * expert),
                                    tokens_per_step=3)
    assert fraction == pytest.approx(10 * roof.step_bytes(3) / 1e9)


def test_default_model_size(default_model_path):
    cfg = ModelConfig.from_pretrained(default_model_path)
    # The GGUF holds 134.5 M parameters (DESIGN.md); the embedding is tied.
    assert rl.model_param_count(cfg) == pytest.approx(134.5e6, rel=1e-3)


def _roofline(flops=100e9, bandwidth=10e9, params=1_000_000_000 // 8):
    return rl.Roofline("float32", flops, bandwidth, bandwidth, bandwidth / 2, params,
                       2.0 * params, 4 * params)


def test_ceilings_take_the_tighter_bound():
    r = _roofline()  # 250 M FLOPs and 500 MB per token / pass
    assert r.compute_tokens_per_s == pytest.approx(100e9 / 250e6)  # 400 tok/s
    assert r.bandwidth_steps_per_s == pytest.approx(10e9 / 500e6)  # 20 passes/s
    assert r.ceiling_tokens_per_s(1) == pytest.approx(20)  # one stream: bandwidth
    assert r.ceiling_tokens_per_s(64) == pytest.approx(400)  # big batch: compute
    assert r.min_seconds(num_tokens=400, num_steps=10) == pytest.approx(1.0)
    assert r.min_seconds(num_tokens=40, num_steps=40) == pytest.approx(2.0)
    assert r.fraction(400, 10, seconds=4.0) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="batch_size"):
        r.ceiling_tokens_per_s(0)


def test_measurements_are_positive_and_finite():
    flops = rl.measure_matmul_flops(torch.float32, size=64, repeats=2, min_seconds=0.0)
    bw = rl.measure_bandwidth(num_bytes=1 << 20, repeats=2, min_seconds=0.0)
    for value in (flops, bw.read, bw.copy, bw.best):
        assert 0 < value < math.inf
    assert bw.best == max(bw.read, bw.copy, bw.matvec)
    from minivllm.cpu import _custom_ops as ops
    if ops.build_problem() is None and ops.packed_linear_available():
        assert 0 < bw.matvec < math.inf
    with pytest.raises(ValueError, match="size"):
        rl.measure_matmul_flops(size=0)


def test_roofline_cli_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    rl.add_cli_args(parser)
    out = tmp_path / "roofline.json"
    args = parser.parse_args(["--dtype", "float32", "--matmul-size", "128",
                              "--min-seconds", "0", "--output", str(out)])
    report = rl.run(args)
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    r = saved["rooflines"][0]
    assert r["dtype"] == "float32" and r["weight_bytes"] == 4 * r["params"]
    assert r["compute_tokens_per_s"] == pytest.approx(r["matmul_flops"] / r["flops_per_token"])
    assert "GFLOP/s" in capsys.readouterr().out


# -- throughput: the report's arithmetic ------------------------------------------------

def _runs():
    R = tp.RunResult
    return [R("minivllm", 2.0, 4, 100, 400), R("hf", 4.0, 4, 100, 400),
            R("minivllm", 1.0, 4, 100, 400), R("hf", 5.0, 4, 100, 400)]


def test_run_rates_and_paired_ratios():
    runs = _runs()
    r = runs[0]
    assert (r.requests_per_s, r.input_tokens_per_s, r.output_tokens_per_s,
            r.total_tokens_per_s) == (2.0, 50.0, 200.0, 250.0)
    # Paired by repeat: (400/2)/(400/4) and (400/1)/(400/5).
    assert tp.paired_ratios(runs, "minivllm", "hf") == [2.0, 5.0]


def test_min_forward_passes():
    assert tp.min_forward_passes([128] * 32, concurrency=32) == 128
    assert tp.min_forward_passes([128] * 256, concurrency=128) == 256
    assert tp.min_forward_passes([10, 200], concurrency=2) == 200  # the longest request
    assert tp.min_forward_passes([5] * 10, concurrency=3) == math.ceil(50 / 3)
    with pytest.raises(ValueError, match="concurrency"):
        tp.min_forward_passes([1], 0)


def test_roofline_fraction_and_stage_shares():
    roof = {"compute_tokens_per_s": 400.0, "bandwidth_steps_per_s": 20.0}
    assert tp.roofline_fraction(roof, num_tokens=800, num_steps=10, seconds=4.0) == 0.5
    assert tp.roofline_fraction(roof, num_tokens=40, num_steps=40, seconds=4.0) == 0.5
    shares = tp.stage_shares({"schedule": 1.0, "forward": 6.0, "sample": 1.0,
                              "detokenize": 2.0, "collective_bytes": 99.0})
    assert shares == {"schedule": 0.1, "forward": 0.6, "sample": 0.1, "detokenize": 0.2}


def test_figure_bars_are_medians_with_ranges():
    args = argparse.Namespace(dataset="chat", dtype="float32", threads=2,
                              omp_wait_policy="passive", repeats=2)
    runs = _runs()
    infos = {"minivllm": {}, "hf": {}}
    report = tp.make_report(args, ["minivllm", "hf"], infos, runs, None, [[1] * 25] * 4,
                            [100] * 4, concurrency=4)
    fig = tp.throughput_figure(report)
    bar = fig.data[0]
    assert list(bar.x) == ["minivllm", "hf"]
    assert list(bar.y) == [300.0, 90.0]  # medians of (200, 400) and (100, 80)
    assert list(bar.error_y.array) == [100.0, 10.0]
    assert list(bar.error_y.arrayminus) == [100.0, 10.0]
    assert report["ratios_output_tokens_per_s"]["hf"]["median"] == 3.5
    from minivllm.cpu.features import cpu_features

    # What the numbers were measured on: the CPU and the kernels' ISA.
    assert report["machine"]["isa"] == cpu_features().isa
    assert report["machine"]["cpu_features"] == cpu_features().describe()


def test_the_roofline_is_that_of_the_dtype_computed():
    f32, b16 = {"dtype": "float32"}, {"dtype": "bfloat16"}
    assert tp.roofline_for({"rooflines": [f32, b16]}, "bfloat16") is b16
    # bfloat16 asked, float32 computed (no native bfloat16): the one measured.
    assert tp.roofline_for({"rooflines": [f32]}, "bfloat16") is f32


# -- workloads -----------------------------------------------------------------------

def test_builtin_prompts_are_varied():
    assert len(CHAT_PROMPTS) == 64 and len(set(CHAT_PROMPTS)) == 64
    chinese = [p for p in CHAT_PROMPTS if any("\u4e00" <= ch <= "\u9fff" for ch in p)]
    assert 8 <= len(chinese) < 32
    w = chat_workload(70, 16)
    assert [r.messages[0]["content"] for r in w[64:]] == list(CHAT_PROMPTS[:6])
    assert all(r.max_tokens == 16 for r in w)


def test_random_workload_lengths_and_tokens():
    avoid = frozenset({0, 1, 2})
    w = random_workload(50, (5, 9), (3, 4), vocab_size=20, seed=1, avoid_token_ids=avoid)
    assert w == random_workload(50, (5, 9), (3, 4), vocab_size=20, seed=1,
                                avoid_token_ids=avoid)
    assert all(5 <= len(r.prompt_token_ids) <= 9 and 3 <= r.max_tokens <= 4 for r in w)
    assert all(3 <= t < 20 for r in w for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match="input_len"):
        random_workload(1, (4, 2), (1, 1), vocab_size=10)


def test_chat_workload_is_the_chat_template(default_model_path, default_tokenizer):
    from tests.conftest import chat_ids

    args = argparse.Namespace(dataset="chat", num_prompts=3, max_tokens=7)
    prompts, max_tokens = tp.build_workload(args, str(default_model_path))
    assert prompts == [chat_ids(default_tokenizer, p) for p in CHAT_PROMPTS[:3]]
    assert max_tokens == [7, 7, 7]


# -- end to end ----------------------------------------------------------------------

@pytest.mark.slow
def test_two_backends_side_by_side(tmp_path, capsys, tiny_chat_model):
    # A tiny model with the default model's tokenizer: the chat workload as it is, and
    # what is checked (the alternation, the report's arithmetic) holds for any model.
    parser = argparse.ArgumentParser()
    tp.add_cli_args(parser)
    out, fig = tmp_path / "t.json", tmp_path / "t.html"
    args = parser.parse_args(["--model", tiny_chat_model, "--backend", "minivllm",
                              "--backend", "hf", "--num-prompts", "3", "--max-tokens", "4",
                              "--repeats", "2", "--output", str(out), "--figure", str(fig)])
    report = tp.run(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert fig.is_file()
    runs = report["runs"]
    # Alternating: the second repeat starts with the other backend.
    assert [r["backend"] for r in runs] == ["minivllm", "hf", "hf", "minivllm"]
    assert all(r["output_tokens"] == 12 for r in runs)  # ignore_eos: exactly 3 x 4
    assert report["ratios_output_tokens_per_s"]["hf"]["count"] == 2
    mv = report["backends"]["minivllm"]
    assert set(mv["step_breakdown_share"]) >= {"schedule", "prepare", "forward", "sample"}
    assert sum(mv["step_breakdown_share"].values()) == pytest.approx(1.0)
    # The fraction is least possible time / time taken, from this report's own numbers
    # (not "< 1": the roofline is measured once, and a busy machine under-measures it).
    roof = tp.roofline_for(report["roofline"], "float32")
    work = report["workload"]
    fractions = sorted(tp.roofline_fraction(roof, work["input_tokens"] + work["output_tokens"],
                                            work["min_forward_passes"], r["seconds"],
                                            mv["info"]["weight_bytes"])
                       for r in runs if r["backend"] == "minivllm")
    assert mv["roofline_fraction"]["median"] == pytest.approx(sum(fractions) / 2)
    assert fractions[0] > 0
    assert "minivllm / hf" in capsys.readouterr().out


@pytest.mark.slow
def test_tensor_parallel_run_reports_its_collectives(tiny_chat_model, tmp_path, monkeypatch,
                                                     capsys):
    """TP=2 on a tiny model: every timed run's collective bytes are the theory's, the
    breakdown counts them once, and the workers are gone when the benchmark is."""
    import uuid

    import psutil

    from minivllm.model.layers.tp_plan import expected_collective_bytes
    from tests.helpers import WORKER_MARK

    tag = uuid.uuid4().hex  # marks the processes this run starts (environment)
    monkeypatch.setenv("MINIVLLM_TEST_RUN", tag)
    parser = argparse.ArgumentParser()
    tp.add_cli_args(parser)
    out = tmp_path / "tp.json"
    args = parser.parse_args(["--model", tiny_chat_model, "--tensor-parallel-size", "2",
                              "--dataset", "random", "--num-prompts", "3", "--input-len", "8",
                              "--output-len", "4", "--repeats", "2", "--threads", "2",
                              "--output", str(out)])
    report = tp.run(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    mv = report["backends"]["minivllm"]
    assert report["workload"]["tensor_parallel_size"] == mv["info"]["tensor_parallel_size"] == 2
    assert mv["info"]["threads_per_rank"] == 1  # the two ranks share --threads 2
    # Each run: one step prefills 3 prompts of 8 tokens (shorter than a block, so no
    # prefix-cache hit on the repeat) and samples 3 tokens; 3 decode steps follow.
    cfg = ModelConfig.from_pretrained(tiny_chat_model, dtype="float32")
    per_run = (expected_collective_bytes(cfg, 24, 2, num_logits_rows=3)
               + 3 * expected_collective_bytes(cfg, 3, 2))
    assert [(r["num_steps"], r["collective_bytes"]) for r in report["runs"]] == \
        [(4, per_run)] * 2
    assert mv["collective_bytes_per_step"] == per_run / 4
    assert mv["collective_seconds_per_step"] > 0 and mv["broadcast_seconds_per_step"] > 0
    # Collectives and the input broadcast happen inside the forward pass: the shares
    # count them once, as themselves.
    seconds, shares = mv["step_breakdown_seconds"], mv["step_breakdown_share"]
    assert seconds["forward"] >= seconds["collective"] + seconds["broadcast"]
    assert shares["collective"] > 0 and shares["broadcast"] > 0
    assert sum(shares.values()) == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "collective" in printed and "minivllm tensor parallel (2 ranks)" in printed
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if WORKER_MARK in " ".join(proc.info["cmdline"] or []) and \
                    proc.environ().get("MINIVLLM_TEST_RUN") == tag:
                left.append(proc)
        except psutil.Error:  # gone meanwhile, or not ours to read
            pass
    assert left == []


def test_report_row_shows_medians_ranges_and_paired_ratios():
    from minivllm.lab.bench.report import machines, row, table

    def stats(values):
        values = sorted(values)
        return {"median": values[1], "min": values[0], "max": values[2]}

    result = {
        "workload": {"num_prompts": 32, "output_tokens": 32 * 128, "dtype": "float32"},
        "backends": {"minivllm": {"output_tokens_per_s": stats([290, 300, 310]),
                                  "roofline_fraction": stats([0.4, 0.5, 0.6])},
                     "vllm": {"output_tokens_per_s": stats([240, 250, 260])}},
        "ratios_output_tokens_per_s": {"vllm": stats([1.1, 1.2, 1.3])},
    }
    line = row(result)
    assert line.startswith("| 32 requests × 128 tokens, float32 | 300 (290–310) | 250 (240–260) |")
    assert "| 1.20× | — | — | 50 % |" in line
    head, rule = table([]).splitlines()[:2]
    assert head.startswith("| workload | minivllm |") and rule.startswith("|---|")
    assert head.count("|") == rule.count("|")
    # A quantized run is labelled by minivllm's quantization; llama.cpp's ratio shows.
    gguf = dict(result, backends={**result["backends"], "llama.cpp": {
        "output_tokens_per_s": stats([90, 100, 110])}},
        ratios_output_tokens_per_s={"llama.cpp": stats([2.9, 3.0, 3.1])})
    gguf["backends"]["minivllm"] = dict(result["backends"]["minivllm"],
                                        info={"quantization": "gguf"})
    line = row(gguf)
    assert line.startswith("| 32 requests × 128 tokens, gguf | 300 (290–310) |")
    assert "| 100 (90–110) | — | — | 3.00× | 50 % |" in line
    # The machine line names each distinct CPU once, as the runs recorded it.
    other = dict(result, roofline={"machine": {"cpu_features": "CPU B (kernels ISA avx2)",
                                               "logical_cpus": 4, "torch": "t"}})
    result["roofline"] = {"machine": {"cpu_features": "CPU A (kernels ISA native)",
                                      "logical_cpus": 2, "torch": "t"}}
    assert machines([result, result, other]) == (
        "Measured on: CPU A (kernels ISA native), 2 logical CPUs, torch t; "
        "CPU B (kernels ISA avx2), 4 logical CPUs, torch t.")


def test_a_peer_that_crashes_is_reported_as_a_crash_with_its_log(tmp_path):
    """A backend process killed by a signal (as llama.cpp's segfault was) is a crash, said at once
    with the signal and the log's tail, not a timeout."""
    import os
    import stat

    fake = tmp_path / "python"  # stands in for the peer's interpreter
    fake.write_text("#!/bin/sh\necho 'loading the peer...' >&2\nread line\nkill -SEGV $$\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    from minivllm.lab.bench.throughput.backend_client import BackendClient, BackendError

    backend_proc = BackendClient("llama.cpp", str(fake), {}, dict(os.environ), tmp_path)
    with pytest.raises(BackendError) as err:
        backend_proc.start(timeout=3600)
    said = str(err.value)
    assert "crashed (SIGSEGV, signal 11)" in said and "gave no answer" not in said
    assert "loading the peer..." in said


def test_a_peer_that_dies_between_requests_is_reported_and_leaves_nothing_running(tmp_path):
    """A backend that answered and then died is a clear error at its next request (it was a
    BrokenPipeError that ended the whole run), and what it started goes with it at close
    (a vLLM worker outlived its killed parent and kept two cores busy)."""
    import os
    import stat
    import time

    from minivllm.lab.bench.throughput.backend_client import BackendClient, BackendError

    left = tmp_path / "left.pid"
    fake = tmp_path / "python"  # ready, then gone; its own child sleeps on
    fake.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {left}\nread line\n"
                    "echo '{\"ready\": true, \"info\": {}, \"load_seconds\": 0}'\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    client = BackendClient("vllm", str(fake), {}, dict(os.environ), tmp_path)
    client.start(timeout=60)
    client.proc.wait(timeout=60)
    with pytest.raises(BackendError, match="exit"):
        client.request({"cmd": "run"}, timeout=60)
    orphan = int(left.read_text())
    for _ in range(100):  # killed by close(): reaped by init a moment later
        if not os.path.exists(f"/proc/{orphan}") or "Z" in open(f"/proc/{orphan}/stat").read().split()[2]:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the backend's child {orphan} still runs after close()")


def test_roofline_fraction_counts_each_engines_own_weight_bytes():
    # 100 MB/s over 5 MB of float32 weights: 20 steps/s; a quantized engine that
    # holds 1 MB could do 100 steps/s, so the same time is a fifth of its roofline.
    roof = {"compute_tokens_per_s": 1e9, "bandwidth_steps_per_s": 20.0, "bandwidth": 100e6}
    float32 = tp.roofline_fraction(roof, num_tokens=40, num_steps=40, seconds=4.0)
    quantized = tp.roofline_fraction(roof, num_tokens=40, num_steps=40, seconds=4.0,
                                     weight_bytes=1_000_000)
    assert float32 == 0.5 and quantized == pytest.approx(float32 / 5)


def test_printed_bandwidth_bound_uses_each_engines_own_weight_bytes():
    """The roofline line of a quantized run prices minivllm's blocks, not float32's
    weights; a peer that reports no weight bytes gets the roofline dtype's."""
    from minivllm.lab.bench.throughput.results import _bandwidth_bounds

    roof = {"dtype": "float32", "bandwidth": 100e6, "weight_bytes": 5_000_000,
            "bandwidth_steps_per_s": 20.0}
    report = {"backends": {"minivllm": {"info": {"weight_bytes": 1_000_000}},
                           "vllm": {"info": {}}}}
    assert _bandwidth_bounds(report, roof) == ["minivllm 1.0 MB -> 100.0",
                                               "vllm 5.0 MB -> 20.0"]
