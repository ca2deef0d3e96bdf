"""Validation (3): a real fleet behind ``minivllm router`` against the simulated fleet.

    minivllm simulate validate --fleet [--num-replicas 3] [--policies ...]

For each policy, starts ``--num-replicas`` real ``minivllm serve`` replicas of
the default model (each publishing KV events) and ``minivllm router`` in front,
and runs a multi-turn chat workload through it (sessions start on a Poisson
schedule; each turn carries the whole conversation so far, sent when the
previous answer arrived, as ``bench serve --dataset-name multiturn`` does).
Then it asks a replica's ``/tokenize`` for every prompt exactly as the
engines saw it, replays those prompts in the simulator with the same replica
count, policy, arrival times and engine arguments, and prints per policy,
real against simulated: cached prompt tokens, median TTFT, output
throughput, and how many requests both routed to the same replica; then once
more with every turn sent when the real one was (the real arrival order: with
concurrent sessions the order turns reach the router is set by real timing,
and round robin's choices follow it), cached tokens and same replica again. A
``single`` row runs one replica with a cache big enough for everything (the
most any router can find), and every answer is compared with that run's.

The replicas share this machine's cores (each engine gets ``--threads``
threads), and so do the simulated ones (``Simulator(host_cores=...)``: a step
takes ``busy replicas x threads / cores`` times longer while the cores are
oversubscribed) and what each core's neighbours take from it (the replicas running
at once split ``Hardware.host_mem_bandwidth`` and ``Hardware.host_flops``, which
``calibrate`` measures with engines running side by side). The calibration should
then be one replica's: made
with the same threads (``OMP_NUM_THREADS=1 minivllm simulate calibrate ...``). A
cache-aware router asks a replica to tokenize each prompt before routing it; the
router's own record of that wait, per request (its ``X-Minivllm-Tokenize-Seconds``
header; the median of ``/stats`` for a router that does not send it), delays that
request in the simulated fleet. Every request's real and simulated TTFT goes to the
JSON. While each fleet runs, the CPU seconds of its engine cores, API servers,
router and client are read from ``/proc`` (``process_cpu``), printed beside the
simulated engines' own, and kept per policy (``rows.<policy>.cpu``); the simulated
fleet's frontend (API servers, router, client) takes the CPU per token and per
request that ``calibrate`` measured (``Hardware.frontend_cpu_s_*``,
``router_cpu_s_*``) from the engines' cores, and the simulated median TTFT without
it is kept too. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Optional

from minivllm.routing import POLICIES
from minivllm.lab.sim import process_cpu
from minivllm.lab.sim.real_fleet import WORDS, Turn, conversations, run_real

def sim_requests(turns: list[Turn], real_order: bool = False):
    """The turns as the simulator's requests: each turn sent when the simulated
    previous answer ends (a closed loop, for the timings); ``real_order``: each
    sent when the real one was, so the router sees the real fleet's order (for
    the routing decisions, which otherwise follow the simulated timing)."""
    from minivllm.lab.bench.workload import SimRequest

    by = {(t.session, t.turn): t for t in turns}
    out = []
    for t in sorted(turns, key=lambda t: (t.session, t.turn)):
        nxt = by.get((t.session, t.turn + 1))
        # The answer as the next prompt holds it, so the simulated cache keeps what
        # the real one keeps (the engine caches its own output blocks too).
        script = (nxt.prompt_ids[len(t.prompt_ids):len(t.prompt_ids) + t.output_tokens]
                  if nxt else [])
        script += [5] * (t.output_tokens - len(script))
        out.append(SimRequest(f"s{t.session}-t{t.turn}", t.prompt_ids, t.output_tokens,
                              t.sent, output_token_ids=script,
                              after=(f"s{t.session}-t{t.turn - 1}"
                                     if t.turn and not real_order else None),
                              session=f"s{t.session}",
                              extra_latency_s=t.tokenize_s or 0.0))
    return out


def run_sim(hw, policy: str, n: int, num_blocks: int, turns: list[Turn], args,
            real_order: bool = False, routing_latency_s: float = 0.0, frontend: bool = True):
    return run_sim_requests(hw, policy, n, num_blocks, sim_requests(turns, real_order), args,
                            routing_latency_s, frontend)


def run_sim_requests(hw, policy: str, n: int, num_blocks: int, requests, args,
                     routing_latency_s: float = 0.0, frontend: bool = True):
    """The simulated fleet; ``frontend``: its API servers, router and client take
    the CPU the calibration measured (``Hardware.frontend_cpu_s_*`` and
    ``router_cpu_s_*``) from the engines' cores."""
    from minivllm.config import EngineArgs
    from minivllm.model.resolve import resolve_model_path
    from minivllm.lab.sim.models import load_model_config
    from minivllm.lab.sim.simulator import Simulator

    path = resolve_model_path(None)
    sim = Simulator(load_model_config(path, "auto", "cpu", args.quantization), hw,
                    EngineArgs(model=str(path), num_kv_blocks=num_blocks,
                               block_size=args.block_size,
                               max_num_batched_tokens=args.max_num_batched_tokens),
                    n, policy, host_cores=args.host_cores or len(os.sched_getaffinity(0)),
                    threads_per_replica=args.threads, routing_latency_s=routing_latency_s,
                    frontend_cpu_s_per_token=(hw.frontend_cpu_s_per_token
                                              + hw.router_cpu_s_per_token) * frontend,
                    frontend_cpu_s_per_request=(hw.frontend_cpu_s_per_request
                                                + hw.router_cpu_s_per_request) * frontend)
    return sim.run(requests)


# -- choosing a workload before any real run ------------------------------------------
def planned_turns(args, tokenizer, seed: int) -> list[Turn]:
    """The workload's turns as the replicas would tokenize them, before any real run:
    each answer a stand-in of ``fleet_output_len`` words (the real ones are the
    model's), session starts on the Poisson schedule of ``seed``."""
    import random

    from minivllm.lab.bench.workload import arrival_times

    rng = random.Random(seed + 7919)
    starts = arrival_times(args.num_sessions, args.session_rate, 1.0, seed)
    turns = []
    for s, conv in enumerate(conversations(args)):
        messages = [{"role": "system", "content": conv[0]}]
        for k, user in enumerate(conv[1:]):
            messages.append({"role": "user", "content": user})
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
            turns.append(Turn(s, k, list(messages), sent=starts[s],
                              output_tokens=args.fleet_output_len,
                              prompt_ids=tokenizer.encode(text, add_special_tokens=False)))
            answer = " ".join(rng.choice(WORDS) for _ in range(args.fleet_output_len))
            messages.append({"role": "assistant", "content": answer})
    return turns


def plan(args, hw, seeds=range(20), jitters=(0.0, 1.0, 3.0), policies=None) -> dict:
    """Cached prompt tokens per policy, simulated over ``seeds`` (session starts) and
    ``jitters`` (each turn sent up to that many seconds late, uniformly: the real
    fleet's timing, which decides the order turns reach the router, varies from run
    to run); returns each policy's and the single big replica's totals per draw, and
    ``kv_aware`` / ``round_robin`` per draw (what ``--plan`` prints)."""
    import random

    from minivllm.inputs import load_tokenizer
    from minivllm.model.resolve import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None))
    policies = list(policies or args.policies)
    out: dict = {p: [] for p in ["single", *policies]}
    for seed in seeds:
        turns = planned_turns(args, tokenizer, seed)
        for jitter in jitters:
            for name in out:
                n, blocks = ((1, args.num_kv_blocks * args.num_replicas * 4) if name == "single"
                             else (args.num_replicas, args.num_kv_blocks))
                reqs = sim_requests(turns)
                rng = random.Random(seed * 1000 + int(jitter * 100))
                for r in reqs:
                    r.think_time = rng.uniform(0.0, jitter)
                result = run_sim_requests(hw, name if n > 1 else "round_robin", n, blocks,
                                          reqs, args)
                out[name].append(summarize_sim(result)["cached_tokens"])
    return out


def print_plan(out: dict) -> None:
    import numpy as np

    print(f"simulated cached prompt tokens over {len(out['single'])} draws (seeds x jitters):")
    for name, v in out.items():
        print(f"  {name:<13} median {np.median(v):>7.0f}  min {min(v):>6}  max {max(v):>6}")
    if "kv_aware" in out and "round_robin" in out:
        ratio = np.array(out["kv_aware"]) / np.maximum(np.array(out["round_robin"]), 1)
        print(f"  kv_aware / round_robin: median {np.median(ratio):.2f}, min {ratio.min():.2f}, "
              f"{(ratio >= 2).mean():.0%} of draws >= 2")


# -- the table ---------------------------------------------------------------------
def ttft_summary(ttfts_s: list[float]) -> dict:
    """Median TTFT and its quartiles (ms): an overloaded fleet's TTFTs fall in two
    modes (requests that queue behind a busy replica and those that do not), and a
    median between them moves with the share in each; the quartiles show the modes."""
    import numpy as np

    q1, med, q3 = np.percentile(ttfts_s, [25, 50, 75]) * 1000
    return {"median_ttft_ms": float(med), "p25_ttft_ms": float(q1), "p75_ttft_ms": float(q3)}


def summarize_real(turns: list[Turn]) -> dict:
    end = max(t.done for t in turns)
    return {"cached_tokens": sum(t.cached_tokens for t in turns),
            **ttft_summary([t.ttft for t in turns]),
            "output_throughput": sum(t.output_tokens for t in turns) / end}


def summarize_sim(result) -> dict:
    reqs = result.requests
    return {"cached_tokens": sum(r.num_cached_tokens for r in reqs),
            **ttft_summary([r.ttft for r in reqs]),
            "output_throughput": sum(r.output_tokens for r in reqs)
            / max(r.finished for r in reqs)}


def per_request(turns: list[Turn], result) -> list[dict]:
    """Each turn real against simulated: where the TTFT and cache gaps come from."""
    sim = {r.request_id: r for r in result.requests}
    out = []
    for t in sorted(turns, key=lambda t: t.sent):
        s = sim[f"s{t.session}-t{t.turn}"]
        out.append({"id": s.request_id, "sent": round(t.sent, 4), "sim_sent": round(s.arrival, 4),
                    "prompt_tokens": t.prompt_tokens, "output_tokens": t.output_tokens,
                    "replica": [t.replica, s.replica],
                    "cached_tokens": [t.cached_tokens, s.num_cached_tokens],
                    "ttft_ms": [round(t.ttft * 1000, 2), round(s.ttft * 1000, 2)],
                    "e2e_ms": [round((t.done - t.sent) * 1000, 2), round(s.e2e * 1000, 2)]})
    return out


def rel(sim: float, real: float) -> float:
    return (sim - real) / real if real else float("nan")


def compare(hw, name: str, n: int, blocks: int, turns: list[Turn], tokenize_s: list,
            texts: dict, reference: dict, args) -> dict:
    """One real run of a fleet against its simulation (the same prompts, send times,
    replica count and policy), as a row of the table."""
    import numpy as np

    n_req = len(turns)
    # Measured, not fitted: the router's median wait for a prompt's tokens.
    # Each request's own wait for its tokens when the router said it (a header; the
    # requests carry it), else the router's median wait for every request.
    own_waits = any(t.tokenize_s is not None for t in turns)
    routing_s = float(np.median(tokenize_s)) if tokenize_s and not own_waits else 0.0
    # Every row's requests are chats through the router: its measured extra path.
    routing_s += hw.router_latency_s
    policy = name if n > 1 else "round_robin"
    result = run_sim(hw, policy, n, blocks, turns, args, routing_latency_s=routing_s)
    bare = run_sim(hw, policy, n, blocks, turns, args, routing_latency_s=routing_s,
                   frontend=False)  # the same without the frontend's CPU: what it adds
    ordered = run_sim(hw, policy, n, blocks, turns, args, real_order=True,
                      routing_latency_s=routing_s)
    sim_replica = {r.request_id: r.replica for r in result.requests}
    ordered_replica = {r.request_id: r.replica for r in ordered.requests}
    real, sim = summarize_real(turns), summarize_sim(result)
    same = sum(sim_replica[f"s{t.session}-t{t.turn}"] == t.replica for t in turns)
    same_ordered = sum(ordered_replica[f"s{t.session}-t{t.turn}"] == t.replica for t in turns)
    cached_ordered = summarize_sim(ordered)["cached_tokens"]
    return {"real": real, "sim": sim,
            "err_cached": rel(sim["cached_tokens"], real["cached_tokens"]),
            "err_ttft": rel(sim["median_ttft_ms"], real["median_ttft_ms"]),
            "same_replica": f"{same}/{n_req}",
            "same_replica_real_order": f"{same_ordered}/{n_req}",
            "cached_tokens_real_order": cached_ordered,
            "err_cached_real_order": rel(cached_ordered, real["cached_tokens"]),
            "same_answers": f"{sum(texts[k] == reference[k] for k in texts)}/{n_req}",
            "replicas": [t.replica for t in turns],
            "router_tokenize_ms": [round(s * 1000, 2) for s in tokenize_s],
            "routing_latency_ms": routing_s * 1000,
            "router_latency_ms": hw.router_latency_s * 1000,
            "tokenize_wait_per_request": own_waits,
            "sim_engine_cpu_s": round(engine_cpu_s(result, args.threads), 3),
            "mean_ttft_ms": [float(np.mean([t.ttft for t in turns])) * 1000,
                             float(np.mean([r.ttft for r in result.requests])) * 1000],
            "sim_median_ttft_ms_no_frontend_cpu": summarize_sim(bare)["median_ttft_ms"],
            "requests": per_request(turns, result)}


def engine_cpu_s(result, threads: int) -> float:
    """The simulated engines' CPU seconds: each step's cost with the cores to itself
    (its duration over its slowdown), times the replica's threads; what the real
    engine cores' CPU seconds (``process_cpu``) are compared with."""
    return sum(s["duration"] / s.get("slowdown", 1.0) for s in result.steps) * threads


def over_runs(per_run: list[dict]) -> dict:
    """Several real runs of one fleet: the medians of the real and of the simulated
    metrics (each run simulated with its own send times), the errors between the
    medians, the real runs' range, and every run kept."""
    import statistics

    def med(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in per_run)

    keys = per_run[0]["real"]
    real = {k: med("real", k) for k in keys}
    sim = {k: med("sim", k) for k in keys}
    ttfts = [r["real"]["median_ttft_ms"] for r in per_run]
    cached = [r["real"]["cached_tokens"] for r in per_run]
    ordered = statistics.median(r["cached_tokens_real_order"] for r in per_run)
    return {"real": real, "sim": sim,
            "err_cached": rel(sim["cached_tokens"], real["cached_tokens"]),
            "err_ttft": rel(sim["median_ttft_ms"], real["median_ttft_ms"]),
            "real_ttft_ms_range": [min(ttfts), max(ttfts)],
            "sim_ttft_within_runs": bool(min(ttfts) <= sim["median_ttft_ms"] <= max(ttfts)),
            # Round robin's cached tokens follow the order turns reach the router,
            # which moves from run to run: the runs' own spread says how close is close.
            "real_cached_range": [min(cached), max(cached)],
            "sim_cached_within_runs": bool(min(cached) <= sim["cached_tokens"] <= max(cached)),
            "same_replica": ",".join(r["same_replica"] for r in per_run),
            "same_replica_real_order": ",".join(r["same_replica_real_order"]
                                                for r in per_run),
            "cached_tokens_real_order": ordered,
            "err_cached_real_order": rel(ordered, real["cached_tokens"]),
            "same_answers": ",".join(r["same_answers"] for r in per_run),
            "runs": per_run}


def print_table(rows: dict) -> None:
    print(f"{'policy':<13}{'cached tok real/sim':>22}{'err':>7}{'TTFT ms real/sim':>21}"
          f"{'err':>7}{'tok/s real/sim':>17}{'same replica':>14}{'same answers':>14}"
          f"{'  real order: cached err, same replica':>40}")
    for name, r in rows.items():
        a, b = r["real"], r["sim"]
        print(f"{name:<13}{a['cached_tokens']:>11}/{b['cached_tokens']:<10}"
              f"{r['err_cached']:>+7.0%}{a['median_ttft_ms']:>10.0f}/"
              f"{b['median_ttft_ms']:<10.0f}{r['err_ttft']:>+7.0%}"
              f"{a['output_throughput']:>8.1f}/{b['output_throughput']:<8.1f}"
              f"{r['same_replica']:>14} {r['same_answers']:>13} "  # runs' lists can be long
              f"{r['err_cached_real_order']:>+23.0%} {r['same_replica_real_order']:>15}")
    for name, r in rows.items():
        if "real_ttft_ms_range" in r:
            lo, hi = r["real_ttft_ms_range"]
            print(f"{name}: real median TTFT over {len(r['runs'])} runs {lo:.0f}-{hi:.0f} ms "
                  f"(median {r['real']['median_ttft_ms']:.0f}), simulated "
                  f"{r['sim']['median_ttft_ms']:.0f}: "
                  f"{'within' if r['sim_ttft_within_runs'] else 'outside'} the runs' range; "
                  f"cached tokens {r['real_cached_range'][0]}-{r['real_cached_range'][1]}, "
                  f"simulated {r['sim']['cached_tokens']}: "
                  f"{'within' if r['sim_cached_within_runs'] else 'outside'}")
    print("TTFT quartiles, ms (p25 / median / p75), real (medians over runs) against simulated")
    for name, r in rows.items():
        a, b = r["real"], r["sim"]
        if "p25_ttft_ms" in a:
            print(f"{name:<13}" + "   ".join(
                f"{x['p25_ttft_ms']:.0f} / {x['median_ttft_ms']:.0f} / {x['p75_ttft_ms']:.0f}"
                for x in (a, b)))


def load_turns(path: str) -> dict:
    """``--turns-file`` back: {policy: [[Turn, ...] per real run]}."""
    return {name: [[Turn(**t) for t in run] for run in runs]
            for name, runs in json.loads(Path(path).read_text()).items()}


def print_cpu(rows: dict) -> None:
    """Where the real fleet's CPU went, against the simulated engines' CPU, and the
    simulated median TTFT without the frontend's CPU (what the model adds)."""
    print("CPU seconds while the turns ran (real: /proc counters; sim: the engines' steps "
          "at full speed)")
    print(f"{'policy':<13}{'wall s':>8}{'engine real/sim':>17}{'API':>7}{'router':>8}"
          f"{'client':>8}{'frontend cores':>16}{'sim TTFT no frontend':>22}"
          f"{'mean TTFT client/server/sim':>29}")
    for name, r in rows.items():
        runs = r.get("runs", [r])
        for run in runs:
            if "cpu" not in run:
                continue
            c, w = run["cpu"]["cpu_s"], run["cpu"]["wall_s"]
            fe = c["api_server"] + c["router"] + c["client"]
            print(f"{name:<13}{w:>8.1f}{c['engine_core']:>9.1f}/{run['sim_engine_cpu_s']:<7.1f}"
                  f"{c['api_server']:>7.1f}{c['router']:>8.1f}{c['client']:>8.1f}"
                  f"{fe / w:>16.2f}{run['sim_median_ttft_ms_no_frontend_cpu']:>22.0f}"
                  f"{mean_ttfts(run):>29}")


def mean_ttfts(run: dict) -> str:
    """Mean TTFT (ms) at the client, at the replicas' API processes (from add_request,
    the prompt tokenized; their /metrics) and simulated: where the time goes."""
    server = run["cpu"].get("server_mean_s", {}).get("time_to_first_token_seconds")
    client, sim = run.get("mean_ttft_ms", [float("nan")] * 2)
    return f"{client:.0f}/{server * 1000 if server else float('nan'):.0f}/{sim:.0f}"


def load_hw(spec: Optional[str]):
    from minivllm.lab.sim.hardware import Hardware, load_hardware

    path = Path(spec or "figures/sim_validation.json")
    if path.is_file():
        data = json.loads(path.read_text())
        return Hardware.from_dict(data.get("hardware", data))
    return load_hardware(spec)


def run(args: argparse.Namespace) -> dict:
    for p in args.policies:
        if p not in POLICIES:
            raise ValueError(f"policies contains {p!r}: each must be one of {', '.join(POLICIES)}")
    hw = load_hw(args.calibration)
    if args.plan:
        out = plan(args, hw, seeds=range(args.seed, args.seed + args.plan_seeds))
        print_plan(out)
        return {"plan": out}
    convs = conversations(args)
    n_req = args.num_sessions * args.num_turns
    big = args.num_kv_blocks * args.num_replicas * 4  # holds everything
    runs = [("single", 1, big)] + [(p, args.num_replicas, args.num_kv_blocks)
                                   for p in args.policies]
    repeats = getattr(args, "real_repeats", 1)
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"real_repeats={repeats!r} is invalid: must be an integer >= 1")
    rows, reference, recorded = {}, None, {}
    for name, n, blocks in runs:
        per_run = []
        for k in range(repeats):
            print(f"{name}: {n} replica(s) x {blocks} blocks, {n_req} requests"
                  + (f", real run {k + 1}/{repeats}" if repeats > 1 else "") + " ...",
                  flush=True)
            turns, tokenize_s, cpu = run_real(name, n, blocks, convs, args)
            print(process_cpu.format_usage(name, cpu), flush=True)
            failed = [t.error for t in turns if t.error]
            if failed or len(turns) != n_req:
                raise RuntimeError(f"{name}: {len(failed)} requests failed: {failed[:2]}")
            texts = {(t.session, t.turn): t.text for t in turns}
            recorded.setdefault(name, []).append([vars(t) for t in turns])
            reference = reference or texts
            per_run.append(compare(hw, name, n, blocks, turns, tokenize_s, texts, reference,
                                   args) | {"cpu": cpu})
        rows[name] = per_run[0] if repeats == 1 else over_runs(per_run)
    print_table(rows)
    print_cpu(rows)
    from minivllm.model.resolve import resolve_model_path
    from minivllm.lab.sim.calibrate import resolved_quantization

    report = {"settings": vars(args) | {"func": None}, "hardware": hw.to_dict(), "rows": rows,
              "quantization": resolved_quantization(resolve_model_path(None),
                                                    args.quantization),
              "targets": {"cached_tokens": 0.10, "median_ttft": 0.20}}
    if args.fleet_output:
        Path(args.fleet_output).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.fleet_output}")
    if getattr(args, "turns_file", None):  # every real turn, to replay in the simulator
        Path(args.turns_file).write_text(json.dumps(recorded))
        print(f"wrote {args.turns_file}")
    return report


def add_cli_args(p: argparse.ArgumentParser) -> None:
    # The default workload: multi-tenant agent sessions whose histories outgrow their
    # system prompts, chosen with --plan (virtual time, 20 session schedules x 3
    # timing jitters, at the calibrated speed and 3x slower) so that kv_aware's lead
    # over round_robin is not a coin toss of arrival order; 16 sessions, not a
    # multiple of 3 replicas, so round robin cannot send a session back by accident.
    g = p.add_argument_group("--fleet")
    g.add_argument("--num-replicas", type=int, default=3)
    g.add_argument("--policies", nargs="+", default=list(POLICIES))
    g.add_argument("--num-sessions", type=int, default=16)
    g.add_argument("--num-turns", type=int, default=5)
    g.add_argument("--system-len", type=int, default=8, help="words of each system prompt")
    g.add_argument("--num-system-prompts", type=int, default=5,
                   help="tenants, each with its own system prompt (session i: tenant i mod N)")
    g.add_argument("--user-len", type=int, default=64, help="words per user turn")
    g.add_argument("--fleet-output-len", dest="fleet_output_len", type=int, default=32)
    g.add_argument("--session-rate", type=float, default=1.0, help="sessions started per s")
    g.add_argument("--num-kv-blocks", type=int, default=160, help="per replica")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    g.add_argument("--host-cores", type=int, default=None,
                   help="cores the replicas share, for the simulator (default: this machine's)")
    g.add_argument("--plan", action="store_true",
                   help="start nothing: simulate the workload over --plan-seeds session "
                   "schedules x 3 timing jitters and print each policy's cached tokens and "
                   "kv_aware / round_robin (is the gap robust, or a coin toss of arrival order?)")
    g.add_argument("--plan-seeds", type=int, default=20)
    g.add_argument("--fleet-file", dest="fleet_output", default="figures/fleet_validation.json")
    g.add_argument("--turns-file", default=None,
                   help="also write every real turn (prompt token ids, send time, replica, "
                   "TTFT) per policy and run, so the simulator can replay them later "
                   "(validate_fleet.load_turns)")
