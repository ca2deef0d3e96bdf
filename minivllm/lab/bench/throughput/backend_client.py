"""The parent side of the backends' processes: start each one (``backend_process.py``),
speak to it in JSON lines, report how it died."""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path


BACKEND_PROCESS = Path(__file__).with_name("backend_process.py")
REPO_ROOT = Path(__file__).resolve().parents[4]


class BackendError(RuntimeError):
    pass


class BackendClient:
    """One backend in its own process, spoken to in JSON lines (see backend_process.py)."""

    def __init__(self, backend: str, python: str, setup: dict, env: dict,
                 log_dir: Path) -> None:
        self.backend = backend
        self.log_path = log_dir / f"{backend}.log"
        self._log = open(self.log_path, "w")
        # A session (and process group) of its own: a peer's own processes (vLLM's engine
        # core and worker) go with it at close, even when it has to be killed.
        self.proc = subprocess.Popen([python, str(BACKEND_PROCESS)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     text=True, bufsize=1, start_new_session=True)
        self.info: dict = {}
        self.load_seconds = 0.0
        self._setup = {"backend": backend, **setup}

    def start(self, timeout: float) -> None:
        reply = self.request(self._setup, timeout)
        if not reply.get("ready"):
            raise BackendError(reply.get("error", "no reason given"))
        self.info, self.load_seconds = reply.get("info", {}), reply["load_seconds"]

    def request(self, message: dict, timeout: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except OSError:  # a broken pipe: it died since its last answer
            ready, line = [self.proc.stdout], ""
        else:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""
        if not line:
            # Readable and empty is the end of the child's output: it died (a
            # crash closes its pipe a moment before it can be reaped), so wait
            # for its exit status instead of reporting a timeout.
            code = self._exit_code(wait=bool(ready))
            self.close()
            why = (exit_description(code) if code is not None
                   else f"gave no answer within {timeout:.0f} s")
            raise BackendError(f"{self.backend} {why}; its log: {self.log_path}\n"
                              + self.log_tail())
        reply = json.loads(line)
        if "error" in reply and not message.get("backend"):
            raise BackendError(f"{self.backend}: {reply['error']}")
        return reply

    def _exit_code(self, wait: bool):
        if not wait:
            return self.proc.poll()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        try:  # whatever it started and left behind (a killed vLLM's worker kept running)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


def exit_description(code: int) -> str:
    """A process's exit status in words: a negative one is the signal that killed it."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"crashed ({name}, signal {-code})"
    return f"exited with code {code}"


def backend_env(args: argparse.Namespace, backend: str) -> dict:
    """The same threading environment for every backend, plus what each one needs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                      env.get("PYTHONPATH")]))
    env["TOKENIZERS_PARALLELISM"] = "false"
    # A crash in native code (a peer's kernels) then leaves its Python stack in the log.
    env["PYTHONFAULTHANDLER"] = "1"
    env["OMP_NUM_THREADS"] = str(args.threads)
    if args.omp_wait_policy != "default":
        # libgomp/libiomp read this when they load: it must be set before the
        # process starts. PASSIVE: idle threads sleep instead of spinning,
        # which on a machine shared with other jobs avoids long stalls.
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    if backend == "vllm":
        # One core list per rank ("0-3|4-7"): the threads are shared, as minivllm's are.
        tp = args.tensor_parallel_size
        per_rank = max(1, args.threads // tp)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
            f"{r * per_rank}-{(r + 1) * per_rank - 1}" for r in range(tp)))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_cache_gb))
    return env


def start_backends(args, backends, model_path, log_dir) -> dict[str, BackendClient]:
    """Start every backend (one at a time: loading is not timed); skip those that fail."""
    from minivllm.inputs import load_tokenizer
    from minivllm.model.resolve import default_gguf_path

    tokenizer = load_tokenizer(model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    setup = {"model": model_path, "dtype": args.dtype, "threads": args.threads,
             "pad_token_id": pad, "hf_batch_size": args.hf_batch_size,
             "hf_cb_attn": args.hf_cb_attn, "vllm_eager": args.vllm_eager,
             "max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_num_batched_tokens,
             "tensor_parallel_size": args.tensor_parallel_size,
             "engine_args": {"max_num_seqs": args.max_num_seqs,
                             "max_num_batched_tokens": args.max_num_batched_tokens,
                             "tensor_parallel_size": args.tensor_parallel_size,
                             "speculative_config": args.speculative_config,
                             "quantization": args.quantization,
                             "activation_dtype": args.activation_dtype}}
    pythons = {"vllm": args.vllm_python, "llama.cpp": args.llama_python,
               "llama.cpp-decode": args.llama_python}
    started: dict[str, BackendClient] = {}
    for name in backends:
        extra = {}
        if name.startswith("llama.cpp"):
            extra["gguf"] = args.gguf or str(default_gguf_path())
        d = BackendClient(name, pythons.get(name) or sys.executable, {**setup, **extra},
                          backend_env(args, name), log_dir)
        try:
            d.start(args.load_timeout)
            d.request({"cmd": "run", "prompts": [[1, 2, 3, 4]] * 2, "max_tokens": [4, 4]},
                      args.run_timeout)  # warm-up, untimed
        except BackendError as e:
            print(f"  {name}: not run: {e}".rstrip(), file=sys.stderr)
            d.close()
            continue
        print(f"  {name}: loaded in {d.load_seconds:.1f} s {d.info}")
        started[name] = d
    return started


