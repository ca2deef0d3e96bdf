"""A Llama decode step in one C++ call (``csrc/llama_decode.cpp``).

In eager PyTorch every operator of a decode step costs twice on a CPU: the
kernel, and the Python around it (the module call, the argument checks, the
dispatcher). A decode step of the default model runs about 300 operators
whose kernels are short, so the Python side adds up to several milliseconds:
about a fifth of a single-stream step on the 2-core CPU. vLLM removes the
same cost on GPUs by capturing the step once as a CUDA graph and replaying
it. Here the layer loop is simply written out in C++ over the kernels the
Python layers call, with the same weights in the same order, so a step gives
bit for bit the hidden states of ``LlamaModel``'s Python loop.

It takes a step only when that equality holds: CPU float32 weights packed
for the panel GEMM (``prepack.py``, AVX-512), one rank, no q/k norm, the
``cpu`` attention backend, a pure decode step (one new token per sequence)
of at most ``PANEL_MAX_ROWS`` sequences, and nobody observing the layers.
Everything else (prefill, mixed steps, bfloat16, tensor parallelism) runs
the Python layers. ``MINIVLLM_FUSED_DECODE=0`` turns it off (for A/B runs).

The weights are captured when it is built (after prepacking); if the layers
are repacked or unpacked later it notices and stands aside.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from minivllm import _custom_ops as ops
from minivllm.model.attention import AttentionMetadata
from minivllm.model.layers.parallel import tp_size
from minivllm.model.layers.prepack import PANEL_MAX_ROWS

ENV_SWITCH = "MINIVLLM_FUSED_DECODE"
_NONE = torch.empty(0)  # "no bias" in the flat weight list


def fused_decode_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _linear_tensors(layer: nn.Module) -> list[torch.Tensor]:
    bias = layer.bias if layer.bias is not None else _NONE
    return [layer.weight, layer.packed_weight.panels, bias]


def _layer_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """One decoder layer's tensors in the order llama_decode.cpp reads them."""
    attn, mlp = layer.self_attn, layer.mlp
    return ([layer.input_layernorm.weight] + _linear_tensors(attn.qkv_proj)
            + _linear_tensors(attn.o_proj) + [layer.post_attention_layernorm.weight]
            + _linear_tensors(mlp.gate_up_proj) + _linear_tensors(mlp.down_proj))


def _linears(model: nn.Module) -> list[nn.Module]:
    return [lin for layer in model.layers
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def fused_decode_problem(model: nn.Module) -> Optional[str]:
    """Why ``model`` (a LlamaModel) cannot take the fused path, or None."""
    if not fused_decode_enabled():
        return f"turned off by {ENV_SWITCH}=0"
    problem = ops.cpu_kernels_problem()
    if problem is not None:
        return problem
    first = model.layers[0]
    if first.input_layernorm.weight.dtype != torch.float32:
        return f"dtype {first.input_layernorm.weight.dtype} (float32 only)"
    if first.input_layernorm.weight.device.type != "cpu":
        return "not on the CPU"
    if tp_size() != 1:
        return "tensor parallelism (the C++ loop has no all-reduce)"
    if first.self_attn.q_norm is not None:
        return "q/k norm (Qwen3) is not in the C++ loop"
    if first.self_attn.attn.backend.name != "cpu":
        return f"attention backend {first.self_attn.attn.backend.name!r} (needs 'cpu')"
    if any(lin.packed_weight is None or lin.packed_weight.panels is None
           for lin in _linears(model)):
        return "linear weights are not packed into panels (prepack off, or no AVX-512)"
    return None


class LlamaFusedDecode:
    """Runs a LlamaModel's pure decode steps through ``llama_decode_forward``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.weights = [t for layer in model.layers for t in _layer_tensors(layer)]
        self.packed = [lin.packed_weight for lin in _linears(model)]
        first = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim, self.scale = first.head_dim, first.attn.scale
        self.eps = model.norm.eps
        self.rotary = first.rotary_emb
        self.steps = 0  # decode steps taken here (the tests check the path is used)
        self._caches: Optional[tuple[list, list]] = None

    def accepts(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A pure decode step this loop can run with the weights it captured."""
        rows = input_ids.shape[0]
        return (meta.max_query_len == 1 and rows == meta.num_seqs and rows <= PANEL_MAX_ROWS
                and self._caches_bound() and self._weights_current())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        k_caches, v_caches = self._caches
        hidden = self.model.embed_tokens(input_ids)
        self.steps += 1
        return ops.llama_decode_forward(
            hidden, positions, meta.slot_mapping, meta.block_tables.to(torch.int32),
            meta.seq_lens.to(torch.int32), self.rotary.cos_cache, self.rotary.sin_cache,
            k_caches, v_caches, self.weights, self.model.norm.weight, self.num_heads,
            self.num_kv_heads, self.head_dim, self.eps, self.scale)

    def _caches_bound(self) -> bool:
        """The attention layers' KV caches (re-read when the runner rebinds them)."""
        attn = [layer.self_attn.attn for layer in self.model.layers]
        if self._caches is None or self._caches[0][0] is not attn[0].k_cache:
            if attn[0].k_cache is None:
                return False
            self._caches = ([a.k_cache for a in attn], [a.v_cache for a in attn])
        return True

    def _weights_current(self) -> bool:
        # Repacking makes new PackedWeight objects; then our captured panels are stale.
        return self.model.layers[0].self_attn.qkv_proj.packed_weight is self.packed[0]
