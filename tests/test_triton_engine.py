"""Issue 4, end to end: the engine with the Triton backend (interpreted on CPU) gives
the same greedy tokens as with the torch reference backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, sys
from minivllm import LLM, SamplingParams
folder = sys.argv[1]
prompts = [[3, 17, 42, 99, 5, 8, 120, 7, 33, 64, 1, 200, 150, 90, 45, 12, 77, 31, 18, 250,
            6, 9, 11][:n] for n in (23, 5, 17, 1)]
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
result = {}
for backend in ("torch", "triton"):
    # Small blocks and a small token budget: chunked prefill and many blocks per sequence.
    llm = LLM(folder, attention_backend=backend, block_size=4, max_num_batched_tokens=16,
              num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result[backend] = [o.outputs[0].token_ids for o in outs]
print(json.dumps(result))
"""


@pytest.mark.slow
def test_engine_triton_equals_torch(tiny_model):
    folder = tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["triton"] == result["torch"]
    assert all(len(t) == 12 for t in result["torch"])
