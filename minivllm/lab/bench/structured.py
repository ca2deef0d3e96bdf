"""`minivllm bench structured`: what constrained decoding costs per engine step.

For each batch size, the same engine runs the same prompts twice in one
process: free, then constrained to a JSON schema that stays open for the
whole run (a long list of small integers, so every step of every request is
masked). Printed per step: the time to fill the token bitmasks (xgrammar,
one row per constrained request), the time to apply them to the logits,
and the whole engine step, free and constrained side by side.
"""

from __future__ import annotations

import argparse
import json
import time

from minivllm.sampling_params import SamplingParams
from minivllm.structured_outputs_params import StructuredOutputsParams

# Open for the whole run: at least this many items, each a short integer.
SCHEMA = {"type": "array", "minItems": 400,
          "items": {"type": "integer", "minimum": 0, "maximum": 999}}
PROMPT = [{"role": "user", "content": "List some numbers as a JSON array."}]


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated (default 1,32)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--json", default=None, help="also write the numbers to this file")


def _one_run(llm, n: int, max_tokens: int, constrained: bool) -> dict:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if constrained \
        else None
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             structured_outputs=so) for i in range(n)]
    manager = llm.engine_core.executor.runner.structured_output
    manager.fill_seconds = manager.apply_seconds = 0.0
    llm.trace.clear()
    start = time.perf_counter()
    outs = llm.chat([PROMPT] * n, params, use_tqdm=False)
    wall = time.perf_counter() - start
    # Decode steps only: the prefill step costs the same either way.
    decode = [r for r in llm.trace.records
              if all(kind == "decode" for _, kind in r.scheduled.values())]
    steps = len(llm.trace.records)
    if constrained:
        for o in outs:  # every answer so far is a prefix of a valid list
            text = o.outputs[0].text
            assert text.startswith("[") and all(c in "0123456789,[ " for c in text), text
    return {"batch": n, "constrained": constrained, "steps": steps,
            "step_ms": 1e3 * sum(r.duration for r in decode) / max(len(decode), 1),
            "fill_ms": 1e3 * manager.fill_seconds / steps,
            "apply_ms": 1e3 * manager.apply_seconds / steps,
            "tokens_per_s": n * max_tokens / wall}


def run(args: argparse.Namespace) -> dict:
    from minivllm import LLM

    sizes = [int(s) for s in str(args.batch_sizes).split(",")]
    rows = []
    with LLM(args.model, trace=True) as llm:
        _one_run(llm, 1, 4, True)  # compile the grammar and warm up once
        for n in sizes:
            for constrained in (False, True):
                rows.append(_one_run(llm, n, args.max_tokens, constrained))
    print(f"{'batch':>5} {'mode':>11} {'step ms':>9} {'fill ms':>8} {'apply ms':>9} "
          f"{'mask/step':>9} {'tok/s':>8}")
    for r in rows:
        mask = r["fill_ms"] + r["apply_ms"]
        print(f"{r['batch']:>5} {'constrained' if r['constrained'] else 'free':>11} "
              f"{r['step_ms']:>9.2f} {r['fill_ms']:>8.3f} {r['apply_ms']:>9.3f} "
              f"{100 * mask / r['step_ms']:>8.1f}% {r['tokens_per_s']:>8.1f}")
    for n in sizes:
        free, con = (next(r for r in rows if r["batch"] == n and r["constrained"] == c)
                     for c in (False, True))
        print(f"batch {n}: constrained step / free step = "
              f"{con['step_ms'] / free['step_ms']:.3f}")
    result = {"rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


__all__ = ["add_cli_args", "run"]
