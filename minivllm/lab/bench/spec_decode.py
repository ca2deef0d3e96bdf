"""`minivllm bench spec-decode`: speculation on vs off, side by side in one run.

    minivllm bench spec-decode --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

Two engines over the same model live in this process, one with the
speculative config and one without. Each workload is rendered to token IDs
once and handed to both: ``grounded`` (rewrite / quote / extract a given
passage: the answer repeats the prompt, which n-gram lookup exploits) and
``chat`` (the benchmarks' plain chat prompts). Each runs at every
``--concurrency`` (``max_num_seqs``, with as many requests as that, and at
least ``--min-requests``), greedy, so both engines must produce the same
tokens (checked). Timed runs alternate on / off, repeat after repeat.

Reported per case: output tokens/s off and on, the speed-up (median of the
paired ratios), acceptance rate, mean accepted length, and whether the
engine switched speculation off (``disable_by_batch_size``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from minivllm.lab.bench.workload import CHAT_PROMPTS

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from minivllm.config.cli import json_dict

    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--speculative-config", type=json_dict("speculative_config"),
                        default=DEFAULT_SPEC, metavar="JSON",
                        help=f"the engine under test (default {json.dumps(DEFAULT_SPEC)})")
    parser.add_argument("--workload", action="append", choices=["grounded", "chat"],
                        default=None, help="repeatable; default both")
    parser.add_argument("--concurrency", type=int, action="append", default=None,
                        help="requests at once (max_num_seqs); repeatable; default 1 and 32")
    parser.add_argument("--min-requests", type=int, default=4,
                        help="requests per run at low concurrency (one after another)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results here")


def workload_prompts(name: str, n: int) -> list[str]:
    from minivllm.lab.bench.workload import grounded_prompts

    if name == "grounded":
        return grounded_prompts(n)
    return [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(n)]


def timed_run(llm, prompts: list[list[int]], params, concurrency: int) -> dict:
    """One run: seconds, tokens, and the acceptance counts of this run only."""
    llm.engine_core.scheduler.config.max_num_seqs = concurrency
    before = len(llm.trace)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    from minivllm.core.spec_decode_stats import SpecDecodingStats

    stats = SpecDecodingStats()
    for r in llm.trace.records[before:]:
        for k, a in r.spec_decode.values():
            stats.observe(k, a)
    llm.trace.clear()
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"seconds": seconds, "tokens": tokens, "stats": stats}


def run(args: argparse.Namespace) -> list[dict]:
    from minivllm import LLM, SamplingParams

    workloads = args.workload or ["grounded", "chat"]
    concurrencies = args.concurrency or [1, 32]
    off = LLM(args.model, trace=True)
    on = LLM(args.model, trace=True, speculative_config=args.speculative_config)
    speculator = on.engine_core.speculator
    tok = off.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"speculative_config: {json.dumps(args.speculative_config)}")
    header = (f"{'workload':<9} {'conc':>4} {'reqs':>4} {'off tok/s':>9} {'on tok/s':>9} "
              f"{'speed-up':>8} {'accept':>7} {'mean len':>8}  note")
    print(header)
    results = []
    for name in workloads:
        for conc in concurrencies:
            n = max(conc, args.min_requests)
            prompts = [tok.encode(tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False) for p in workload_prompts(name, n)]
            for llm in (off, on):  # warm-up, untimed
                timed_run(llm, prompts[:min(2, n)], params, conc)
            ratios, runs = [], {"off": [], "on": []}
            disabled_before = speculator.num_disabled_steps
            for rep in range(args.repeats):
                order = [("off", off), ("on", on)][::1 if rep % 2 == 0 else -1]
                for label, llm in order:
                    runs[label].append(timed_run(llm, prompts, params, conc))
                a, b = runs["off"][-1], runs["on"][-1]
                if a["tokens"] != b["tokens"]:
                    raise AssertionError(f"{name} at concurrency {conc}: speculation "
                                         "changed the greedy tokens")
                ratios.append(a["seconds"] / b["seconds"])
            num_tokens = sum(len(t) for t in runs["off"][0]["tokens"])
            stats = runs["on"][0]["stats"]
            for r in runs["on"][1:]:
                stats.add(r["stats"])
            disabled = speculator.num_disabled_steps > disabled_before
            row = {"workload": name, "concurrency": conc, "requests": n,
                   "output_tokens": num_tokens,
                   "off_tokens_per_s": num_tokens / statistics.median(
                       r["seconds"] for r in runs["off"]),
                   "on_tokens_per_s": num_tokens / statistics.median(
                       r["seconds"] for r in runs["on"]),
                   "speedup": statistics.median(ratios), "speedups": ratios,
                   "acceptance_rate": stats.acceptance_rate,
                   "mean_accepted_length": stats.mean_accepted_length,
                   "switched_off": disabled}
            results.append(row)
            note = "same tokens" + ("; speculation switched off (disable_by_batch_size)"
                                    if disabled else "")
            print(f"{name:<9} {conc:>4} {n:>4} {row['off_tokens_per_s']:>9.1f} "
                  f"{row['on_tokens_per_s']:>9.1f} {row['speedup']:>7.2f}x "
                  f"{row['acceptance_rate']:>6.1%} {row['mean_accepted_length']:>8.2f}  {note}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    off.shutdown()
    on.shutdown()
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
