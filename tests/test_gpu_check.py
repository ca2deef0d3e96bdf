"""``make gpu-check`` (minivllm/lab/gpu_check.py) on a machine without CUDA: a clear
message, status 0, nothing written; and its parity step, run on the CPU with a tiny
model, finds the engine equal to Hugging Face (the script's own code paths, so a
lent GPU's minutes are not spent on a typo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minivllm.lab import gpu_check

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_says_so_and_exits_0(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "-m", "minivllm.lab.gpu_check", "--output", str(out)],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device" in done.stdout
    assert not out.exists()


@pytest.mark.slow
def test_parity_step_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "PARITY_PROMPTS", 3)
    monkeypatch.setattr(gpu_check, "PARITY_TOKENS", 6)
    tiny = dict(gpu_check.MODEL, vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                initializer_range=0.1)
    assert gpu_check.build_model(tmp_path, tiny) > 0
    report = gpu_check.check_parity(tmp_path, 256, cpu_kernels=False)
    for name in ("eager", "cuda_graphs"):
        assert report[name]["prompts_equal"] == 3, report
        assert report[name]["graph_replays"] is None  # the CPU never captures
