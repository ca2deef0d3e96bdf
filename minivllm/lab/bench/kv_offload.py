"""`minivllm bench kv-offload`: the offload tier on a multi-turn workload larger than the pool.

    minivllm bench kv-offload --conversations 6 --turns 3 --pool-fraction 0.33

Conversations take turns, round-robin: each turn's prompt is the conversation
so far (its first prompt, earlier answers, a new user message). The primary
KV pool is sized to ``--pool-fraction`` of all the history, so by the time a
conversation comes back its prefix has been evicted. Run twice, side by side
in one process: without a second tier, and with ``kv_offloading_size`` host
memory behind it. Printed: prefix hit rate (prompt tokens not computed), mean
TTFT, and whether the tokens were the same (greedy).
"""

from __future__ import annotations

import argparse
import random
import statistics

BLOCK_SIZE = 16


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--first-len", type=int, default=200, help="tokens of the first prompt")
    parser.add_argument("--user-len", type=int, default=60, help="tokens each later turn adds")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--pool-fraction", type=float, default=1 / 3,
                        help="primary KV pool as a fraction of all history tokens")
    parser.add_argument("--offload-gib", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)


def _workload(args, vocab: int) -> list[list[list[int]]]:
    """Per conversation, per turn: the new user tokens (the first turn: the first prompt)."""
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    return [[draw(args.first_len)] + [draw(args.user_len) for _ in range(args.turns - 1)]
            for _ in range(args.conversations)]


def _run_one(args, workload, num_blocks: int, offload_gib) -> dict:
    from minivllm import LLM, SamplingParams

    llm = LLM(args.model, block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
              kv_offloading_size=offload_gib)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    history = [[] for _ in workload]
    tokens, ttft, prompt, cached = [], [], 0, 0
    try:
        for turn in range(args.turns):
            for c, conv in enumerate(workload):
                history[c] = history[c] + conv[turn]
                out = llm.generate([history[c]], params, use_tqdm=False)[0]
                history[c] = history[c] + list(out.outputs[0].token_ids)
                tokens.append(list(out.outputs[0].token_ids))
                m = out.metrics
                ttft.append(m.first_token_time - m.arrival_time)
                prompt += len(out.prompt_token_ids)
                cached += out.num_cached_tokens
        stats = dict(llm.engine_core.kv_connector.stats) if offload_gib else {}
    finally:
        llm.shutdown()
    return {"tokens": tokens, "hit_rate": cached / prompt, "ttft_ms": 1000 * statistics.mean(ttft),
            "prompt_tokens": prompt, "tier": stats}


def run(args: argparse.Namespace) -> dict:
    from minivllm.model.resolve import resolve_model_path
    from minivllm.config import ModelConfig

    vocab = ModelConfig.from_pretrained(resolve_model_path(args.model)).vocab_size
    workload = _workload(args, vocab)
    total = sum(len(t) for conv in workload for t in conv) + \
        args.conversations * args.turns * args.max_tokens
    longest = max(sum(len(t) for t in conv) for conv in workload) + args.turns * args.max_tokens
    num_blocks = max(int(total * args.pool_fraction) // BLOCK_SIZE, -(-longest // BLOCK_SIZE) + 1)
    print(f"history {total} tokens over {args.conversations} conversations x {args.turns} "
          f"turns; primary pool {num_blocks} blocks = {num_blocks * BLOCK_SIZE} tokens "
          f"({num_blocks * BLOCK_SIZE / total:.2f} of the history)")
    without = _run_one(args, workload, num_blocks, None)
    with_tier = _run_one(args, workload, num_blocks, args.offload_gib)
    for name, r in (("no tier", without), (f"+{args.offload_gib} GiB tier", with_tier)):
        print(f"{name:>16}: prefix hit rate {r['hit_rate']:.1%}, mean TTFT {r['ttft_ms']:.0f} ms "
              f"{r['tier']}")
    print(f"TTFT ratio (tier / no tier): {with_tier['ttft_ms'] / without['ttft_ms']:.2f}; "
          f"tokens identical: {with_tier['tokens'] == without['tokens']}")
    return {"without": without, "with": with_tier}


__all__ = ["add_cli_args", "run"]
