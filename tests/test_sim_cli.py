"""`simulate` and `bench serve` share one command line: the same workload flags
draw the same priorities, and ``--output`` writes the same keys."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest

from minivllm.lab.bench import serve
from minivllm.entrypoints.cli import main
from tests.test_bench_serve import StreamingServer

WORKLOAD = ["--dataset-name", "random", "--num-prompts", "24", "--random-input-len", "20",
            "--random-output-len", "4", "--request-rate", "200", "--seed", "5",
            "--priority-classes", "0:1", "3:2", "--goodput", "ttft:100000"]


@pytest.fixture
def server():
    s = StreamingServer(first_delay=0.001, gap=0.001)
    yield s
    s.close()


def bench_serve(argv):
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return serve.run(parser.parse_args(argv))


def key_tree(obj):
    """The nested keys of a JSON object (values left out)."""
    if isinstance(obj, dict):
        return {k: key_tree(v) for k, v in obj.items()}
    return None


def test_the_same_flags_give_the_same_keys_and_priorities(server, tmp_path):
    measured_out, simulated_out = tmp_path / "serve.json", tmp_path / "sim.json"
    m = bench_serve(["--base-url", server.url, "--endpoint-type", "completions",
                     "--random-vocab-size", "49152", *WORKLOAD,
                     "--output", str(measured_out)])
    assert m.failed == 0
    assert main(["simulate", "--model", "smollm2-135m", "--hardware", "h100-sxm",
                 "--scheduling-policy", "priority", *WORKLOAD, "--disable-tqdm",
                 "--output", str(simulated_out)]) == 0
    measured = json.loads(measured_out.read_text())
    simulated = json.loads(simulated_out.read_text())
    # Every key bench serve writes (but the server's URL) is in the simulated run,
    # and the metrics have the same keys all the way down.
    assert set(measured) - {"base_url"} <= set(simulated)
    for k in ("request_rate", "burstiness", "max_concurrency"):
        assert simulated[k] == measured[k]
    assert key_tree(simulated["metrics"]) == key_tree(measured["metrics"])
    assert key_tree(simulated["metrics_by_priority"]) == key_tree(
        measured["metrics_by_priority"])
    # The server was sent the priorities the simulator gave its requests.
    drawn = serve.draw_priorities(24, serve.parse_priority_classes(["0:1", "3:2"]), 5)
    assert set(drawn) == {0, 3}
    assert Counter(b["priority"] for b in server.requests) == Counter(drawn)
    for run in (measured, simulated):
        by = run["metrics_by_priority"]
        assert {p: c["completed"] for p, c in by.items()} == {
            str(p): n for p, n in Counter(drawn).items()}
        assert sum(c["total_output_tokens"] for c in by.values()) == \
            run["metrics"]["total_output_tokens"]


def test_multiturn_sessions_keep_one_priority_in_both(server):
    flags = ["--dataset-name", "multiturn", "--num-prompts", "12", "--multiturn-num-turns",
             "2", "--multiturn-system-len", "8", "--multiturn-user-len", "6",
             "--multiturn-output-len", "3", "--request-rate", "200", "--seed", "2",
             "--priority-classes", "0:1", "1:1"]
    bench_serve(["--base-url", server.url, *flags])
    sessions: dict[str, set] = {}
    for b in server.requests:  # a session's first user turn names it
        sessions.setdefault(b["messages"][1]["content"], set()).add(b["priority"])
    assert len(sessions) == 6 and all(len(p) == 1 for p in sessions.values())
    drawn = serve.draw_priorities(6, serve.parse_priority_classes(["0:1", "1:1"]), 2)
    assert Counter(p for s in sessions.values() for p in s) == Counter(drawn)

    from minivllm.lab.sim.cli import add_cli_args, build

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    _, work = build(parser.parse_args(["--model", "smollm2-135m", *flags]))
    by_session = {}
    for w in work:
        by_session.setdefault(w.session, set()).add(w.priority)
    assert all(len(p) == 1 for p in by_session.values())
    assert [by_session[f"s{i}"].pop() for i in range(6)] == drawn


def test_priority_policy_serves_the_urgent_class_first(tmp_path):
    """Under load (16 slots, 96 requests at once) the priority policy admits the
    priority-0 quarter first: its TTFT drops, the batch class's rises."""
    runs = {}
    for policy in ("fcfs", "priority"):
        out = tmp_path / f"{policy}.json"
        assert main(["simulate", "--model", "llama-3-8b", "--hardware", "h100-sxm",
                     "--max-num-seqs", "16", "--scheduling-policy", policy,
                     "--dataset-name", "random", "--num-prompts", "96",
                     "--random-input-len", "256", "--random-output-len", "32",
                     "--priority-classes", "0:1", "1:3", "--disable-tqdm", "--no-steps",
                     "--output", str(out)]) == 0
        runs[policy] = json.loads(out.read_text())
    ttft = {k: {p: m["ttft_ms"]["median"] for p, m in v["metrics_by_priority"].items()}
            for k, v in runs.items()}
    assert ttft["priority"]["0"] < ttft["fcfs"]["0"] / 2
    assert ttft["priority"]["1"] > ttft["fcfs"]["1"]
    # Same requests, same tokens: only the order changed.
    assert runs["priority"]["metrics"]["total_output_tokens"] == \
        runs["fcfs"]["metrics"]["total_output_tokens"]


@pytest.mark.parametrize("bad", ["0:x", "a:1", "0:0", "1:1 1:2"])
def test_bad_priority_classes_name_the_flag(bad, capsys):
    assert main(["simulate", "--priority-classes", *bad.split(), "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "priority_classes=" in err and "PRIORITY:WEIGHT" in err


def test_the_gpu_presets_against_vllms_published_latency(tmp_path, capsys):
    """Validation (3): each preset within 30 % of vLLM's own nightly measurement
    (figures/records/simulator.md quotes this command's output)."""
    from minivllm.lab.sim.published import PUBLISHED

    out = tmp_path / "published.json"
    assert main(["simulate", "published", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["hardware"] for r in rows} == {"h100-sxm", "h200", "a100-80g"}
    assert len(rows) == len(PUBLISHED)
    for r in rows:
        ratio = r["simulated_latency_ms"] / r["median_latency_ms"]
        assert r["error"] == pytest.approx(ratio - 1)
        assert abs(r["error"]) < 0.3, r
    # A faster GPU is simulated faster, as measured.
    by = {r["hardware"]: r["simulated_latency_ms"] for r in rows}
    assert by["h200"] < by["h100-sxm"] < by["a100-80g"]
    assert "h100-sxm" in capsys.readouterr().out


def test_the_moe_preset_against_a_published_latency(tmp_path):
    """Qwen3-30B-A3B on an A100 (vLLM, one request at a time; chapter 25 and
    figures/records/moe.md give the gap): the rows, their errors, and a longer prompt
    simulated slower, as measured."""
    from minivllm.lab.sim.published import PUBLISHED_MOE

    out = tmp_path / "published_moe.json"
    assert main(["simulate", "published", "--moe", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["model"], r["input_len"]) for r in rows] == [
        (m.model, m.input_len) for m in PUBLISHED_MOE] == [("qwen3-30b-a3b", 128),
                                                           ("qwen3-30b-a3b", 2048)]
    for r in rows:
        assert r["error"] == pytest.approx(r["simulated_latency_ms"]
                                           / r["median_latency_ms"] - 1)
    assert rows[0]["simulated_latency_ms"] < rows[1]["simulated_latency_ms"]


def test_validate_wants_two_rates_before_it_starts_anything(capsys):
    assert main(["simulate", "validate", "--rates", "1"]) == 2
    assert "rates=[1.0] is invalid" in capsys.readouterr().err


def test_validate_judges_each_metric_by_its_own_target():
    from minivllm.lab.sim.validate import TARGETS, rows

    def one_run(ttft, gap, n=3, tokens=5):
        results = [serve.RequestResult(True, 4, tokens, start=i,
                                       chunk_times=[i + ttft + gap * k for k in range(tokens)],
                                       end=i + ttft + gap * (tokens - 1))
                   for i in range(n)]
        return serve.compute_metrics(results, duration=10.0)

    measured, simulated = one_run(0.100, 0.020), one_run(0.112, 0.024)
    table = {r["metric"]: r for r in rows(measured, simulated)}
    assert set(table) == set(TARGETS)
    assert table["median TTFT (ms)"]["error"] == pytest.approx(0.12)
    assert table["median TTFT (ms)"]["within_target"]  # 12 % <= 15 %
    assert table["median TPOT (ms)"]["error"] == pytest.approx(0.20)
    assert not table["median TPOT (ms)"]["within_target"]
    assert table["output throughput (tok/s)"]["error"] == pytest.approx(0.0)


def test_the_random_dataset_is_the_same_requests_in_both():
    """Same flags, same requests: prompt and output lengths, send times, priorities."""
    from minivllm.lab.sim.cli import add_cli_args, build

    flags = ["--dataset-name", "random", "--num-prompts", "30", "--random-input-len", "40",
             "--random-output-len", "12", "--random-range-ratio", "0.5",
             "--random-prefix-len", "5", "--request-rate", "7", "--burstiness", "0.5",
             "--seed", "11", "--priority-classes", "0:1", "2:1"]
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--endpoint-type", "completions", *flags])
    bodies = serve.build_payloads(args)
    sent_at = serve.arrival_times(30, args.request_rate, args.burstiness, args.seed)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    _, work = build(parser.parse_args(["--model", "smollm2-135m", *flags]))
    assert [len(b["prompt"]) for b in bodies] == [len(w.prompt_token_ids) for w in work]
    assert len({len(b["prompt"]) for b in bodies}) > 5  # lengths do vary
    assert [b["max_tokens"] for b in bodies] == [w.output_len for w in work]
    assert [b["priority"] for b in bodies] == [w.priority for w in work]
    assert sent_at == pytest.approx([w.arrival_time for w in work])
    # The shared prefix, token for token (same vocabulary: the default model's).
    assert {tuple(b["prompt"][:5]) for b in bodies} == {tuple(work[0].prompt_token_ids[:5])}
