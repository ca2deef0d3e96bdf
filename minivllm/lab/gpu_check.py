"""``make gpu-check``: the GPU path checked in one run, for a lent GPU machine.

minivllm is developed on a CPU; its CUDA path (Triton attention, CUDA graphs of
decode steps, the KV cache sized from ``gpu_memory_utilization``) runs when a GPU
machine is lent, often briefly and without network. This script is all such a
machine has to run (about 2-4 minutes on an H100; its budget is 5), with Python,
torch (CUDA), triton and transformers only:

1. builds a random Llama of about 170M parameters locally (no download);
2. **parity**: greedy tokens of Hugging Face against the engine on CUDA in float32,
   eager (``enforce_eager=True``) and with CUDA graphs, and counts the replays;
3. **bandwidth**: the Triton decode kernel's achieved bytes/s reading the KV cache,
   against the device's (a large device-to-device copy);
4. **throughput**: 1, 32 and 128 requests in bfloat16, graphs against eager;

and writes ``figures/gpu_check.json`` and ``figures/gpu_check.md``. Without a CUDA
device it prints "no CUDA device" and exits with status 0, having run nothing
(``make test`` never needs it). Exit status 1: a parity check failed (the files are
written first).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

NO_CUDA = "no CUDA device: `make gpu-check` needs one; nothing was run"
# About 170M parameters: big enough that the kernels, not the launches, take the time.
MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, initializer_range=0.05)
PARITY_PROMPTS, PARITY_TOKENS = 8, 32
THROUGHPUT_REQUESTS, PROMPT_LEN, OUTPUT_LEN = (1, 32, 128), 128, 128
DEVICE = "cuda"  # (the tests run the parity step on "cpu" with a tiny model)


def build_model(folder: Path, config: dict = MODEL) -> int:
    """A random Llama saved with transformers; returns its parameter count."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def free_cuda() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def hf_greedy(folder: Path, token_lists: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Hugging Face's greedy continuation of each prompt, one at a time, past EOS (the
    engine runs with ignore_eos): the whole sequence again each step, no cache API
    (it changes across transformers versions)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32).to(DEVICE).eval()
    out = []
    with torch.inference_mode():
        for ids in token_lists:
            x = torch.tensor([ids], device=DEVICE)
            for _ in range(max_tokens):
                nxt = model(input_ids=x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                x = torch.cat([x, nxt], dim=1)
            out.append(x[0, len(ids):].tolist())
    del model
    free_cuda()
    return out


def engine_run(folder: Path, token_lists: list[list[int]], max_tokens: int,
               **engine_args) -> dict:
    """The engine's greedy tokens, wall time and what it set up (blocks, graphs)."""
    from minivllm import LLM, SamplingParams

    llm = LLM(str(folder), device=DEVICE, seed=0, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": ids} for ids in token_lists]
    llm.generate(batch[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    runner = llm.engine_core.executor.runner
    graphs = runner.cuda_graphs
    replays_before = graphs.replays if graphs is not None else 0
    sync()
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
              "num_kv_blocks": llm.engine_core.num_blocks,
              "attention_backend": runner.attn_backend.name,
              "graphs_problem": getattr(runner, "cuda_graphs_problem", "not on CUDA"),
              "graph_sizes": None if graphs is None else graphs.sizes,
              "graph_replays": None if graphs is None else graphs.replays - replays_before}
    llm.shutdown()
    del llm, runner, graphs
    free_cuda()
    return result


def check_parity(folder: Path, vocab: int, **engine_args) -> dict:
    token_lists = prompts(PARITY_PROMPTS, 24, vocab, seed=1)
    want = hf_greedy(folder, token_lists, PARITY_TOKENS)
    report = {}
    for name, eager in (("eager", True), ("cuda_graphs", False)):
        got = engine_run(folder, token_lists, PARITY_TOKENS, dtype="float32",
                         enforce_eager=eager, max_model_len=256, **engine_args)
        matching = [g == w for g, w in zip(got["tokens"], want)]
        first_diff = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
                      for g, w in zip(got["tokens"], want)]
        report[name] = {"prompts_equal": sum(matching), "prompts": len(want),
                        "first_difference": first_diff,
                        **{k: got[k] for k in ("attention_backend", "graphs_problem",
                                               "graph_replays", "num_kv_blocks")}}
    return report


def cuda_time(fn, repeats: int) -> float:
    """Seconds per call of ``fn`` on the GPU (CUDA events, after two warm-up calls)."""
    fn(), fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """The device's achievable bytes/s: read + write of a large copy."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), 10)
    del src, dst
    free_cuda()
    return 2 * num_bytes / seconds


def decode_kernel_bandwidth(num_seqs: int = 64, context: int = 4096, num_kv_heads: int = 8,
                            group: int = 4, head_dim: int = 128, block_size: int = 16) -> dict:
    """The Triton paged-attention kernel on a decode step over a bfloat16 KV cache."""
    from minivllm.model.attention.backend import AttentionMetadata
    from minivllm.model.attention.triton_attn import TritonAttentionBackend

    dtype, dev = torch.bfloat16, "cuda"
    blocks_per_seq = context // block_size
    num_blocks = num_seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=dev)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=dev).view(num_seqs, blocks_per_seq).int()
    meta = AttentionMetadata(
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device=dev),
        slot_mapping=torch.full((num_seqs,), -1, dtype=torch.int64, device=dev),
        block_tables=tables, max_query_len=1, max_seq_len=context)
    q = torch.randn(num_seqs, num_kv_heads * group, head_dim, dtype=dtype, device=dev)
    backend = TritonAttentionBackend()
    seconds = cuda_time(lambda: backend.forward(q, q, q, k_cache, v_cache, meta, 0.088), 20)
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    del k_cache, v_cache
    free_cuda()
    return {"num_seqs": num_seqs, "context": context, "num_kv_heads": num_kv_heads,
            "head_dim": head_dim, "kv_bytes": kv_bytes, "seconds": seconds,
            "bytes_per_s": kv_bytes / seconds}


def check_throughput(folder: Path, vocab: int) -> list[dict]:
    rows = []
    for n in THROUGHPUT_REQUESTS:
        token_lists = prompts(n, PROMPT_LEN, vocab, seed=2)
        row = {"requests": n, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN}
        for name, eager in (("eager", True), ("cuda_graphs", False)):
            got = engine_run(folder, token_lists, OUTPUT_LEN, dtype="bfloat16",
                             enforce_eager=eager, max_model_len=512)
            row[name] = {"output_tok_per_s": n * OUTPUT_LEN / got["seconds"],
                         "seconds": got["seconds"], "graph_replays": got["graph_replays"]}
        row["graphs_speedup"] = (row["cuda_graphs"]["output_tok_per_s"]
                                 / row["eager"]["output_tok_per_s"])
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    """The short page beside the JSON."""
    dev = result["device"]
    lines = [f"# GPU check: {dev['name']}", "",
             f"{dev['total_gib']:.0f} GiB, torch {dev['torch']}, triton {dev['triton']}; "
             f"a random Llama of {result['model_params'] / 1e6:.0f}M parameters; "
             f"{result['seconds']:.0f} s in all.", "", "## Parity with Hugging Face (float32)",
             "", "| run | prompts equal | graph replays | KV blocks |", "|---|---|---|---|"]
    for name, p in result["parity"].items():
        lines.append(f"| {name} | {p['prompts_equal']}/{p['prompts']} | {p['graph_replays']} "
                     f"| {p['num_kv_blocks']} |")
    bw = result["bandwidth"]
    lines += ["", "## Triton decode kernel", "",
              f"{bw['kernel']['bytes_per_s'] / 1e9:.0f} GB/s reading the KV cache "
              f"({bw['kernel']['num_seqs']} sequences x {bw['kernel']['context']} tokens), "
              f"{bw['kernel_share_of_copy']:.0%} of a device copy's "
              f"{bw['copy_bytes_per_s'] / 1e9:.0f} GB/s.", "",
              "## Throughput (bfloat16, output tokens/s)", "",
              "| requests | eager | CUDA graphs | graphs / eager |", "|---|---|---|---|"]
    for row in result["throughput"]:
        lines.append(f"| {row['requests']} | {row['eager']['output_tok_per_s']:.0f} | "
                     f"{row['cuda_graphs']['output_tok_per_s']:.0f} | "
                     f"{row['graphs_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def device_info() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "total_gib": props.total_memory / (1 << 30),
            "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version()}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="figures/gpu_check.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    start = time.perf_counter()
    result: dict = {"device": device_info()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        result["model_params"] = build_model(folder)
        vocab = MODEL["vocab_size"]
        result["parity"] = check_parity(folder, vocab)
        print("parity:", {k: f"{v['prompts_equal']}/{v['prompts']}"
                          for k, v in result["parity"].items()}, flush=True)
        copy = copy_bandwidth()
        kernel = decode_kernel_bandwidth()
        result["bandwidth"] = {"copy_bytes_per_s": copy, "kernel": kernel,
                               "kernel_share_of_copy": kernel["bytes_per_s"] / copy}
        print(f"bandwidth: kernel {kernel['bytes_per_s'] / 1e9:.0f} GB/s, "
              f"copy {copy / 1e9:.0f} GB/s", flush=True)
        result["throughput"] = check_throughput(folder, vocab)
    result["seconds"] = time.perf_counter() - start
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    ok = all(p["prompts_equal"] == p["prompts"] for p in result["parity"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
