"""`minivllm bench disagg`: one engine against a prefill/decode pair, side by side.

    minivllm bench disagg --num-prompts 16 --request-rate 1 --random-input-len 768

Starts, one after the other on this machine: a single ``minivllm serve``; then a
prefill server and a decode server (``P2pConnector``) behind ``minivllm
disagg-proxy``. Each gets the same ``bench serve`` workload (streamed random
prompts of varied length arriving while earlier requests decode) and the
table compares decode inter-token latency (ITL p99: the stall a long prompt
puts into everyone else's stream), TTFT and throughput. With ``--pin`` the
pair's servers get one CPU core each and the single engine both (Linux
``taskset``): the same hardware, split. A shared machine makes every number
noisy: read the ratios, and rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from minivllm.lab.bench import serve as bench_serve


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None, help="model to serve (default: SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--random-input-len", type=int, default=768)
    parser.add_argument("--random-range-ratio", type=float, default=0.9)
    parser.add_argument("--random-output-len", type=int, default=48)
    parser.add_argument("--pin", action="store_true", help="one core per server of the pair")
    parser.add_argument("--output", default=None, help="write both results as JSON here")


def _serve(*args: str, cores=None, threads: int = 1):
    from minivllm.entrypoints.launch import ServerProcess

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    srv = ServerProcess(*args, env=env)
    if cores is not None and shutil.which("taskset"):
        subprocess.run(["taskset", "-a", "-p", "-c", cores, str(srv.proc.pid)],
                       check=False, capture_output=True)
    srv.wait_until_healthy()
    return srv


def _bench(url: str, args) -> dict:
    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    ns = parser.parse_args([
        "--base-url", url, "--endpoint-type", "completions", "--dataset-name", "random",
        "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
        "--random-input-len", str(args.random_input_len),
        "--random-range-ratio", str(args.random_range_ratio),
        "--random-output-len", str(args.random_output_len)])
    m = bench_serve.run(ns)
    return {"itl_p99_ms": m.itl_ms["p99"], "itl_mean_ms": m.itl_ms["mean"],
            "ttft_mean_ms": m.ttft_ms["mean"], "tpot_mean_ms": m.tpot_ms["mean"],
            "output_throughput": m.output_throughput, "failed": m.failed}


def run(args: argparse.Namespace) -> dict:
    from minivllm.entrypoints.launch import free_port

    common = [args.model_path] if args.model_path else []
    results = {}
    srv = _serve(*common, cores="0,1" if args.pin else None, threads=2)
    try:
        results["one engine"] = _bench(srv.url, args)
    finally:
        srv.stop()
    kv = lambda role: json.dumps({"kv_connector": "P2pConnector", "kv_role": role})  # noqa
    prefill = _serve(*common, "--kv-transfer-config", kv("kv_producer"),
                     cores="0" if args.pin else None)
    decode = _serve(*common, "--kv-transfer-config", kv("kv_consumer"),
                    cores="1" if args.pin else None)
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "minivllm.entrypoints.cli", "disagg-proxy",
                              "--prefill", prefill.url, "--decode", decode.url,
                              "--port", str(port)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        time.sleep(5)  # the proxy's uvicorn start
        results["prefill/decode pair"] = _bench(f"http://127.0.0.1:{port}", args)
    finally:
        proxy.terminate()
        proxy.wait(30)
        prefill.stop()
        decode.stop()
    print(f"\n{'':>22} {'ITL p99 ms':>11} {'ITL mean':>9} {'TTFT mean':>10} "
          f"{'TPOT mean':>10} {'out tok/s':>10}")
    for name, r in results.items():
        print(f"{name:>22} {r['itl_p99_ms']:>11.1f} {r['itl_mean_ms']:>9.1f} "
              f"{r['ttft_mean_ms']:>10.1f} {r['tpot_mean_ms']:>10.1f} "
              f"{r['output_throughput']:>10.2f}")
    a, b = results["one engine"], results["prefill/decode pair"]
    print(f"ITL p99 ratio (pair / one engine): {b['itl_p99_ms'] / a['itl_p99_ms']:.2f}; "
          f"output throughput ratio: {b['output_throughput'] / a['output_throughput']:.2f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    return results


__all__ = ["add_cli_args", "run"]
