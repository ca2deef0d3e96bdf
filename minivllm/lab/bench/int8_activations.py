"""``python -m minivllm.lab.bench.int8_activations``: what ``activation_dtype="int8"``
costs in accuracy on the default GGUF file.

Three engines on the file's blocks: float32 activations (``gguf``, the float
path's numbers), int8 activations (``gguf`` + ``int8``), and for scale a
rounding the issue accepts (at most 1 % perplexity): the float32 weights
quantized again to Q8_0 at load (``q8_0``). For each:

- perplexity of a held-out text (this repository's README, written after the
  model was trained), teacher-forced, and its change against float activations;
- top-1 agreement with float activations: at each position of that text, does
  the engine's most likely next token equal the float path's?
- greedy generation from a few prompts: the first position where the tokens
  differ from the float path's (or "same").

Accuracy, not speed: ``minivllm bench throughput --activation-dtype int8`` and
``python -m minivllm.lab.bench.gguf_gemv`` measure the speed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import numpy as np

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Write a haiku about the sea.", "List three prime numbers:"]
ENGINES = {"gguf": dict(quantization="gguf"),
           "gguf int8": dict(quantization="gguf", activation_dtype="int8"),
           "q8_0": dict(quantization="q8_0")}


def held_out_tokens(tokenizer, count: int) -> list[int]:
    readme = Path(__file__).resolve().parents[3] / "README.md"
    return tokenizer(readme.read_text())["input_ids"][:count]


def teacher_forced(llm, ids: list[int]) -> tuple[float, list[int]]:
    """Perplexity of ids after the first, and the most likely token at each position."""
    from minivllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    nll, top1 = [], []
    for t, lp in zip(ids[1:], out.prompt_logprobs[1:]):
        nll.append(-lp[t].logprob)
        top1.append(next(tok for tok, p in lp.items() if p.rank == 1))
    return float(np.exp(np.mean(nll))), top1


def greedy(llm, max_tokens: int) -> list[list[int]]:
    from minivllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def run(args: argparse.Namespace) -> dict:
    from minivllm import LLM

    results = {}
    for name, kwargs in ENGINES.items():
        llm = LLM(enable_prefix_caching=False, max_model_len=2048,
                  cpu_kernels=args.cpu_kernels, **kwargs)
        ids = held_out_tokens(llm.get_tokenizer(), args.tokens)
        ppl, top1 = teacher_forced(llm, ids)
        results[name] = {"perplexity": ppl, "top1": top1, "greedy": greedy(llm, args.max_tokens)}
        del llm
    base = results["gguf"]
    print(f"# {args.tokens} README tokens teacher-forced; greedy {args.max_tokens} tokens from "
          f"{len(PROMPTS)} prompts; cpu_kernels={args.cpu_kernels}")
    print(f"{'engine':<10} {'perplexity':>10} {'vs gguf':>8} {'top-1 = gguf':>13}  "
          f"greedy: first token unlike gguf's")
    for name, r in results.items():
        agree = np.mean([a == b for a, b in zip(r["top1"], base["top1"])])
        r["ppl_change"] = r["perplexity"] / base["perplexity"] - 1
        r["top1_agreement"] = float(agree)
        r["first_difference"] = [first_difference(a, b) for a, b in zip(r["greedy"],
                                                                         base["greedy"])]
        diffs = ", ".join("same" if d is None else str(d) for d in r["first_difference"])
        print(f"{name:<10} {r['perplexity']:>10.4f} {r['ppl_change']:>+8.3%} {agree:>13.2%}  "
              f"{diffs}")
    return results


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="held-out tokens")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=None,
                        help="the kernels (default: where they build) or the reference path")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
