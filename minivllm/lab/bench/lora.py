"""`minivllm bench throughput --lora-modules ...`: a mixed multi-LoRA batch vs the base model.

    minivllm bench throughput --lora-modules random:4 --num-prompts 32 --max-tokens 128
    minivllm bench throughput --lora-modules a=/path/a b=/path/b

One engine (``enable_lora=True``, one slot per adapter) runs the same
workload twice per repeat, in alternating order: every request on the base
model, then the requests spread round-robin over the adapters (one step
mixes them all). Both runs generate greedily and ignore EOS, so they produce
the same number of tokens; the ratio LoRA / base is paired per repeat.
``random:N`` writes N random rank-``--max-lora-rank`` adapters over all seven
projections, in PEFT's format, to a temporary folder.

What the delta costs: per wrapped layer, a shrink and an expand over the
step's adapters — on the CPU path one BGMV kernel call each for all of them
(``minivllm/cpu/lora.py``), inside the one-call decode-step replay for decode
steps; on the reference path one torch product per adapter
(``minivllm/lora/punica.py``). The adapters' factors are read once per step:
the delta's bytes next to the base weights' are what it costs. The step-time
breakdown of both runs is printed next to each other.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from minivllm.metrics.summary import summarize


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="minivllm only: measure a batch mixed over these LoRA adapters "
                             "against the base model (name=path ..., or random:N)")
    parser.add_argument("--max-lora-rank", type=int, default=16,
                        help="with --lora-modules: the engine's max_lora_rank (and the rank "
                             "of random:N adapters)")


def write_random_adapter(folder: Path, model_config, rank: int, seed: int) -> Path:
    """A PEFT-format adapter with small random factors on every projection."""
    import torch
    from safetensors.torch import save_file

    from minivllm.lora.peft_loader import SUPPORTED_MODULES, module_shapes

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for module, (n_in, n_out) in module_shapes(model_config).items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": list(SUPPORTED_MODULES), "base_model_name_or_path": None}))
    return folder


def resolve_adapters(values: list[str], model_config, rank: int):
    from minivllm.entrypoints.openai.serving_models import parse_lora_modules
    from minivllm.lora.request import LoRARequest

    if len(values) == 1 and values[0].startswith("random:"):
        count = values[0].split(":", 1)[1]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--lora-modules {values[0]!r} is invalid: random:N needs N >= 1")
        root = Path(tempfile.mkdtemp(prefix="minivllm-lora-"))
        modules = [(f"random-{i}", str(write_random_adapter(root / f"random-{i}",
                                                             model_config, rank, i)), None)
                   for i in range(int(count))]
    else:
        modules = parse_lora_modules(values)
    return [LoRARequest(name, i + 1, path) for i, (name, path, _) in enumerate(modules)]


def run_lora(args: argparse.Namespace) -> dict:
    from minivllm import LLM, SamplingParams
    from minivllm.lab.bench.throughput.run import build_workload
    from minivllm.config import ModelConfig
    from minivllm.model.resolve import resolve_model_path

    if args.backend and set(args.backend) != {"minivllm"}:
        raise ValueError("--lora-modules measures minivllm only: drop --backend")
    model_path = str(resolve_model_path(args.model))
    loras = resolve_adapters(args.lora_modules, ModelConfig.from_pretrained(
        model_path, args.dtype), args.max_lora_rank)
    prompts, max_tokens = build_workload(args, model_path)
    mixed = [loras[i % len(loras)] for i in range(len(prompts))]
    print(f"workload: {len(prompts)} requests over {len(loras)} adapters "
          f"({', '.join(lo.lora_name for lo in loras)}) vs the base model, "
          f"{sum(max_tokens)} output tokens each run")
    # A KV cache just big enough for the whole workload at once: memory is shared here.
    blocks = sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, max_tokens)) + 16
    llm = LLM(args.model, dtype=args.dtype, trace=True, enable_lora=True, num_kv_blocks=blocks,
              max_loras=len(loras), max_cpu_loras=len(loras),
              max_lora_rank=args.max_lora_rank, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]

    def timed(lora_requests) -> tuple[float, dict]:
        llm.trace.clear()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False, lora_request=lora_requests)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / seconds, llm.trace.time_breakdown()

    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:len(loras)]],
                     SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False,
                     lora_request=loras)  # warm-up: every adapter loaded in its slot
        runs = {"base": [], "lora": []}
        breakdowns = {}
        for repeat in range(args.repeats):
            order = ("base", "lora") if repeat % 2 == 0 else ("lora", "base")
            for kind in order:
                rate, breakdowns[kind] = timed(None if kind == "base" else mixed)
                runs[kind].append(rate)
            print(f"repeat {repeat + 1}: base {runs['base'][-1]:.1f} tok/s, "
                  f"{len(loras)} adapters {runs['lora'][-1]:.1f} tok/s, "
                  f"ratio {runs['lora'][-1] / runs['base'][-1]:.2f}", flush=True)
    finally:
        llm.shutdown()
    ratios = [a / b for a, b in zip(runs["lora"], runs["base"])]
    report = {"num_adapters": len(loras), "num_requests": len(prompts),
              "base_output_tokens_per_s": summarize(runs["base"]).as_dict(),
              "lora_output_tokens_per_s": summarize(runs["lora"]).as_dict(),
              "lora_over_base": summarize(ratios).as_dict(), "breakdown": breakdowns}
    r = report["lora_over_base"]
    print(f"LoRA ({len(loras)} adapters) / base output tokens/s: {r['median']:.2f}x "
          f"(paired per repeat: {', '.join(f'{x:.2f}' for x in ratios)}; noisy on a shared "
          f"machine)")
    for kind, b in breakdowns.items():
        print(f"{kind} step time (s, last run): " + ", ".join(
            f"{k} {v:.3f}" for k, v in b.items() if v))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    return report


__all__ = ["add_lora_args", "run_lora", "write_random_adapter"]
