"""The llama.cpp peer of ``bench throughput``, driven through its real backend process.

The batched decode loop (several sequences, one ``llama_decode`` a step) must make
the tokens llama.cpp's own ``generate`` makes for each prompt alone, also when the
slots run out and a finished sequence's slot is taken by the next prompt. These
tests need ``llama-cpp-python``: the interpreter in ``LLAMA_PYTHON`` (as the
Makefile's), else ``make llama-peer``'s ``~/peers/llama/bin/python``; they skip
where neither has it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import chat_ids

# Each test starts llama.cpp's backend process twice (about 40 s on a loaded 2-core machine).
pytestmark = pytest.mark.slow

def _llama_python() -> str:
    python = os.environ.get("LLAMA_PYTHON") or str(Path.home() / "peers/llama/bin/python")
    try:
        ok = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True,
                            timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip(f"no llama-cpp-python at {python} (make llama-peer; or LLAMA_PYTHON=...)")
    return python


QUESTIONS = ("What is the capital of France?", "Name three colours.",
             "Write one sentence about the sea, please.")
MAX_TOKENS = [12, 7, 16]


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [chat_ids(default_tokenizer, q) for q in QUESTIONS]


def _backend(backend: str, tmp_path, **setup):
    from minivllm.lab.bench.throughput.backend_client import BackendClient
    from minivllm.model.resolve import default_gguf_path

    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONFAULTHANDLER="1")
    tmp_path.mkdir(parents=True, exist_ok=True)
    backend_proc = BackendClient(backend, _llama_python(),
                                 {"gguf": str(default_gguf_path()), "threads": 2, **setup},
                                 env, tmp_path)
    backend_proc.start(timeout=600)
    return backend_proc


def _run(backend_proc, prompts, max_tokens) -> list[list[int]]:
    reply = backend_proc.request({"cmd": "run", "prompts": prompts,
                                  "max_tokens": max_tokens, "return_token_ids": True},
                                 timeout=600)
    assert reply["output_tokens"] == max_tokens  # EOS ignored: exactly max_tokens each
    return reply["token_ids"]


def test_batched_decode_makes_generates_tokens(prompts, tmp_path):
    # Two slots for three prompts: the third waits for the first slot to free.
    backend_proc = _backend("llama.cpp", tmp_path, max_num_seqs=2)
    try:
        assert "batched llama_decode" in backend_proc.info["loop"]
        assert backend_proc.info["max_parallel_sequences"] == 2
        alone = [_run(backend_proc, [p], [n])[0] for p, n in zip(prompts, MAX_TOKENS)]
        together = _run(backend_proc, prompts, MAX_TOKENS)
        assert together == alone
        assert len({tuple(t) for t in alone}) == 3  # three different answers
        # The slots are emptied between runs: a second batched run is the same.
        assert _run(backend_proc, prompts[::-1], MAX_TOKENS[::-1]) == alone[::-1]
    finally:
        backend_proc.close()


def test_decode_loop_for_one_prompt_equals_generate(prompts, tmp_path):
    generate = _backend("llama.cpp", tmp_path / "generate")
    try:
        expected = _run(generate, prompts[:1], [24])
    finally:
        generate.close()
    # One slot and 8 tokens a step: the prompt is fed over several steps, too.
    decode = _backend("llama.cpp-decode", tmp_path / "decode", max_num_seqs=1,
                     max_num_batched_tokens=8)
    try:
        assert decode.info["loop"] == "batched llama_decode"
        assert _run(decode, prompts[:1], [24]) == expected
    finally:
        decode.close()
