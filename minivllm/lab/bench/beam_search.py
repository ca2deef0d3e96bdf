"""Beam search's wall time, this checkout against another one, side by side.

    python -m minivllm.lab.bench.beam_search --against /path/to/other/checkout

``LLM.beam_search`` (4 beams x 16 tokens by default, one chat prompt) is
timed in a fresh process per checkout and round, the checkouts taking turns
(and who goes first alternating), so a burst of outside load on a shared
machine spoils a round of both rather than one side. Each process loads the
default engine (``--engine-args``: the same ``LLM(...)`` arguments in both;
``--other-engine-args`` for the other alone), warms up with one search, then
times ``--repeats`` searches, each from an empty prefix cache. Printed: every
run's seconds and the tokens the engine computed, the median per checkout,
the ratio this / other, and whether both found the same beams. Without
``--against`` only this checkout is timed.

What it was made for: the beams now run as plain one-token requests over the
prefix cache (``entrypoints/beam_search.py``), where they used to fork their
KV blocks inside the engine (commit 443e012). A step's request recomputes its
beam's partly filled last block, up to ``block_size`` tokens, where a fork
computed one token; the token counts show that cost apart from the timing.

Each checkout runs its own package (``PYTHONPATH``). Their C++ kernels build
into folders keyed by their sources' path, except in checkouts older than
2f524c8: against one of those, give ``--extensions-dir`` (one
``TORCH_EXTENSIONS_DIR`` per side under it), or the two builds take turns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

# Run in the checkout under test, with its own package: only public API that
# both the forked-blocks and the prefix-cache versions have.
CHILD = r"""
import json, sys, time
from minivllm import LLM, BeamSearchParams

width, max_tokens, repeats = map(int, sys.argv[1:4])
llm = LLM(**json.loads(sys.argv[5]))
tok = llm.get_tokenizer()
prompt = tok.encode(tok.apply_chat_template(
    [{"role": "user", "content": sys.argv[4]}], tokenize=False,
    add_generation_prompt=True), add_special_tokens=False)
computed = [0]
scheduler = llm.engine_core.scheduler
schedule = scheduler.schedule

def counting_schedule():
    so = schedule()
    computed[0] += so.total_num_scheduled_tokens
    return so

scheduler.schedule = counting_schedule
params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
llm.beam_search({"prompt_token_ids": prompt}, params)  # warm-up
times, tokens = [], []
for _ in range(repeats):
    llm.engine_core.reset_prefix_cache()  # each search starts from an empty cache
    computed[0] = 0
    t0 = time.perf_counter()
    out = llm.beam_search({"prompt_token_ids": prompt}, params)
    times.append(time.perf_counter() - t0)
    tokens.append(computed[0])
print(json.dumps({"times": times, "computed_tokens": tokens, "prompt_len": len(prompt),
                  "beams": [b.tokens for b in out[0].sequences]}))
"""

PROMPT = "Describe the sea in one short sentence."
THIS = str(Path(__file__).resolve().parents[3])


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--against", default=None, metavar="DIR",
                        help="the other checkout's root (its minivllm/ is imported)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="timed searches per process")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt", default=PROMPT, help="the user message (chat template)")
    parser.add_argument("--engine-args", default="{}", metavar="JSON",
                        help='LLM(**JSON) in both checkouts, e.g. \'{"block_size": 4}\'')
    parser.add_argument("--other-engine-args", default=None, metavar="JSON",
                        help="LLM(**JSON) in the other checkout (default: --engine-args)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of each process (default: torch's own)")
    parser.add_argument("--extensions-dir", default=None, metavar="DIR",
                        help="parent of one TORCH_EXTENSIONS_DIR per checkout "
                             "(default: the environment's, for both)")


def run_once(label: str, root: str, args: argparse.Namespace) -> dict:
    """One process in checkout ``root``: its timings as the child prints them."""
    env = dict(os.environ, PYTHONPATH=root)
    if args.extensions_dir is not None:
        folder = Path(args.extensions_dir) / f"minivllm_beam_bench_{label}"
        env["TORCH_EXTENSIONS_DIR"] = str(folder)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    engine_args = args.engine_args
    if label == "other" and args.other_engine_args is not None:
        engine_args = args.other_engine_args
    cmd = [sys.executable, "-c", CHILD, str(args.beam_width), str(args.max_tokens),
           str(args.repeats), args.prompt, engine_args]
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {label} checkout ({root}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    for name in ("rounds", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: must be >= 1")
    trees = {"this": THIS}
    if args.against is not None:
        trees["other"] = str(Path(args.against).resolve())
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for r in range(args.rounds):
        order = list(trees.items())
        for label, root in order if r % 2 == 0 else reversed(order):
            res = run_once(label, root, args)
            runs[label].append(res)
            print(f"round {r} {label:5s} s: {' '.join(f'{t:.3f}' for t in res['times'])}"
                  f"  computed tokens: {res['computed_tokens']}", flush=True)
    return summarize(runs)


def summarize(runs: dict[str, list[dict]]) -> dict:
    summary = {label: {"median_s": statistics.median(t for r in rs for t in r["times"]),
                       "computed_tokens": rs[-1]["computed_tokens"][-1]}
               for label, rs in runs.items()}
    first = next(iter(runs.values()))[-1]
    line = (f"prompt {first['prompt_len']} tokens; median s: "
            + ", ".join(f"{k} {v['median_s']:.3f}" for k, v in summary.items()))
    if "other" in runs:
        summary["ratio"] = summary["this"]["median_s"] / summary["other"]["median_s"]
        summary["same_beams"] = runs["this"][-1]["beams"] == runs["other"][-1]["beams"]
        line += f"; this/other = {summary['ratio']:.2f}; same beams: {summary['same_beams']}"
    print(line)
    return summary


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
