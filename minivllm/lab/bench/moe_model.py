"""A random mixture of experts to benchmark, built locally (no hub access needed).

Issue 54's benchmark model: a Qwen3-MoE of hidden 1024, 16 layers, 64 experts of
intermediate 256, top-8, 16 query and 4 KV heads — about 0.9B parameters (0.85B of
them experts), 0.15B active per token — with the default model's tokenizer and chat
template, so ``bench throughput``'s chat prompts tokenize. Build it, then measure::

    python -m minivllm.lab.bench.moe_model /tmp/moe-0.8b
    minivllm bench throughput --model /tmp/moe-0.8b --backend minivllm --backend hf

``--ab-experts`` times one layer's experts instead, the reference against the CPU
path's twin (``minivllm/cpu/fused_moe.py``) on float32 and on Q8_0 experts
(``quantization="q8_0"``), alternated in one run. On the 0.8b preset's layer, one
thread, a shared 2-core Sapphire Rapids (load ~13), medians of 31: float32 1.24 / 36.1 /
99.9 ms, Q8_0 0.76 / 12.4 / 56.2 ms at 1 / 32 / 256 tokens (1.6-2.9x: a quarter the
bytes of weights); with two threads the machine's load hid both behind its time slices.

``--ab-replay`` times a whole decode step of the ``small`` preset (4 layers of 16
experts, top-4, a vocabulary of 4,096 so that the layers make the step) with the
decode-step replay (``cpu/fused_decode.py``: its sparse layers ``fused_decode_moe.py``)
and without it (the runner runs the twins' Python layers), alternated in one engine
per batch, 512 tokens of context, medians of 7 rounds of 4 steps. On a shared 2-core
Sapphire Rapids (load average 2-4 from other programs), wall time::

    OMP_NUM_THREADS=1   1 sequence  3.04 ms vs 4.66 ms (1.54x)   8: 13.2 vs 15.6 ms (1.18x)
    two threads         1 sequence  2.67 ms vs 4.48 ms (1.68x)   8: 35.0 vs 59.3 ms (1.69x)

(another two-thread run at 8 sequences measured mostly the load: 223 vs 269 ms, 1.20x.)

Random weights: the tokens mean nothing, but every product is the real size, which
is what a throughput measurement needs (``--ignore-eos`` lengths come from the workload).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

PRESETS = {
    "0.8b": dict(hidden_size=1024, num_hidden_layers=16, num_experts=64,
                 moe_intermediate_size=256, num_experts_per_tok=8, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, intermediate_size=2048),
    # The decode-step replay's A/B (--ab-replay): the layers, not the LM head, make a step.
    "small": dict(hidden_size=512, num_hidden_layers=4, num_experts=16,
                  moe_intermediate_size=256, num_experts_per_tok=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, intermediate_size=1536),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_experts=8, moe_intermediate_size=32,
                 num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128),
}


def build_moe_model(out: str | Path, preset: str = "0.8b", seed: int = 0,
                    vocab_size: int | None = None) -> Path:
    """Save a random Qwen3-MoE of ``preset`` with the default model's tokenizer in ``out``
    (with ``vocab_size``: that vocabulary and no tokenizer, for token ids only)."""
    import torch
    import transformers

    from minivllm.model.resolve import resolve_model_path

    if vocab_size is None:
        tokenizer_dir = resolve_model_path(None)
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)
    else:
        ids = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2)
    config = transformers.Qwen3MoeConfig(norm_topk_prob=True, max_position_embeddings=4096,
                                         tie_word_embeddings=True, **ids, **PRESETS[preset])
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    if vocab_size is not None:
        return out
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json", "generation_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def experts_ab(tokens=(1, 32, 256, 1357), repeats: int = 7, preset: str = "0.8b") -> list[dict]:
    """One layer's experts of ``preset``, the reference ``FusedMoE`` (a Python loop over
    the experts) against the CPU twin (one ``moe_expert_sum`` call), alternated in one
    run: median seconds each, per token count (32 tokens: a decode step of the benchmark's
    32 sequences; 1,357: its prefill). The two outputs are checked equal first."""
    import time

    import torch

    from minivllm.cpu.fused_moe import CpuFusedMoE
    from minivllm.model.layers.fused_moe import FusedMoE

    p = PRESETS[preset]
    shape = (p["num_experts"], p["num_experts_per_tok"], p["hidden_size"],
             p["moe_intermediate_size"], True, torch.float32)
    ref = FusedMoE(*shape)
    torch.manual_seed(0)
    for w in (ref.w13_weight, ref.w2_weight):
        w.data.normal_(0, 0.03)
    twin = FusedMoE(*shape)
    twin.w13_weight, twin.w2_weight = ref.w13_weight, ref.w2_weight  # the same one copy
    twin.__class__ = CpuFusedMoE
    q8 = quantized_twin(ref, shape)
    variants = (("reference", ref), ("cpu", twin), ("cpu_q8_0", q8))
    rows = []
    with torch.inference_mode():
        for t in tokens:
            x, logits = torch.randn(t, p["hidden_size"]), torch.randn(t, p["num_experts"])
            torch.testing.assert_close(twin(x, logits), ref(x, logits), atol=1e-4, rtol=1e-4)
            # Q8_0 weights: within their rounding (about 1/254 of a block's largest)
            torch.testing.assert_close(q8(x, logits), ref(x, logits), atol=2e-2, rtol=2e-2)
            seconds = {name: [] for name, _ in variants}
            for _ in range(repeats):
                for name, layer in variants:
                    start = time.perf_counter()
                    layer(x, logits)
                    seconds[name].append(time.perf_counter() - start)
            med = {k: sorted(v)[len(v) // 2] for k, v in seconds.items()}
            rows.append({"tokens": t, **med, "speedup": med["reference"] / med["cpu"]})
    return rows


def quantized_twin(ref, shape):
    """``ref``'s experts as the CPU twin holds them under quantization="q8_0": Q8_0
    blocks, quantized per expert and projection as the loader does."""
    from minivllm.cpu.fused_moe import CpuFusedMoE
    from minivllm.model.layers.fused_moe import FusedMoE
    from minivllm.model.layers.quantization import get_quantization_config
    from minivllm.model.layers.quantization.q8_0 import quantize_checkpoint_tensor

    q8 = FusedMoE(*shape, quant_config=get_quantization_config("q8_0"))
    i = ref.intermediate_size
    for e in range(shape[0]):
        for which, w in (("w1", ref.w13_weight[e, :i]), ("w3", ref.w13_weight[e, i:]),
                         ("w2", ref.w2_weight[e])):
            q8.load_quantized(quantize_checkpoint_tensor(w, which, "q8_0"), (e, which))
    q8.__class__ = CpuFusedMoE
    return q8


def replay_ab(preset: str = "small", seqs=(1, 8), context: int = 512, rounds: int = 7,
              steps: int = 4) -> list[dict]:
    """A decode step of a random ``preset`` model (a vocabulary of 4,096, so that the
    layers make the step) with the decode-step replay (``cpu/fused_decode.py``, its MoE
    layers ``cpu/fused_decode_moe.py``) and without it (the runner runs the twins'
    Python layers), in one engine per batch of ``seqs`` sequences of ``context``
    prompt tokens, the two taking turns (``ab_timing.alternate``): medians of
    ``rounds`` rounds of ``steps`` steps each."""
    import tempfile

    from minivllm.lab.bench.ab_timing import alternate
    from minivllm.lab.bench.hybrid_decode import decoding_engine

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_moe_model(Path(tmp) / "moe", preset, vocab_size=4096))
        for n in seqs:
            llm = decoding_engine(path, n, context)
            runner = llm.llm_engine.engine_core.executor.runner
            replay = runner.decode_replay
            if replay is None:
                raise RuntimeError(f"no decode-step replay: {runner.decode_replay_problem}")

            def step(with_replay: bool):
                runner.decode_replay = replay if with_replay else None
                llm.llm_engine.step()

            before = replay.steps
            t = alternate({"replay": lambda: step(True), "layers": lambda: step(False)},
                          rounds=rounds, calls=steps)
            assert replay.steps - before == rounds * steps + 1  # (a warm-up step) all replayed
            llm.shutdown()
            rows.append({"seqs": n, "replay": t.median("replay"), "layers": t.median("layers"),
                         "speedup": t.ratio("layers", "replay")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="the folder to write")
    parser.add_argument("--ab-experts", action="store_true",
                        help="instead: time one layer's experts, reference vs CPU twin")
    parser.add_argument("--ab-replay", action="store_true",
                        help="instead: time a decode step with the decode-step replay and "
                             "without (--preset small by default)")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.ab_replay:
        for row in replay_ab(preset=args.preset or "small"):
            print(f"{row['seqs']:3d} sequences: replay {row['replay'] * 1e3:8.2f} ms, "
                  f"Python layers {row['layers'] * 1e3:8.2f} ms ({row['speedup']:.2f}x)")
        return
    args.preset = args.preset or "0.8b"
    if args.ab_experts:
        for row in experts_ab(preset=args.preset):
            print(f"{row['tokens']:5d} tokens: reference {row['reference'] * 1e3:8.2f} ms, "
                  f"cpu {row['cpu'] * 1e3:8.2f} ms ({row['speedup']:.2f}x), "
                  f"cpu q8_0 {row['cpu_q8_0'] * 1e3:8.2f} ms")
        return
    if args.out is None:
        parser.error("give the folder to write (or --ab-experts)")
    print(build_moe_model(args.out, args.preset, args.seed))


if __name__ == "__main__":
    main()
