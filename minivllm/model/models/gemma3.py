"""Gemma 3 (text): the Llama skeleton with local and global attention layers.

What differs from ``llama.py``, each a line or two below:

* layers alternate kinds (``config.layer_types``): most are *sliding* (a token
  sees the last ``sliding_window`` positions, RoPE base ``rope_local_base_freq``,
  10,000 by default), every sixth by default *global* (the whole context, RoPE
  base 1,000,000, maybe scaled). The KV cache keeps them in separate KV cache
  groups (``minivllm/core/kv_cache_interface.py``), and frees a sliding
  layer's blocks once they fall out of its window;
* the embedding is multiplied by ``sqrt(hidden_size)``;
* every norm is RMSNorm times ``(1 + weight)`` (weights stored around 0), and
  each block has four: before and after attention, before and after the MLP
  ("sandwich" norms); q and k get a per-head RMSNorm before RoPE;
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, not
  ``head_dim ** -0.5``; the MLP is GeGLU (tanh-approximated GELU);
* the final logits are soft-capped, ``cap * tanh(logits / cap)``, when
  ``final_logit_softcapping`` is set.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import ModelConfig
from minivllm.model.attention import Attention, AttentionBackend, AttentionMetadata
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                          RowParallelLinear)
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

SLIDING = "sliding_attention"


class GemmaRMSNorm(RMSNorm):
    """RMSNorm times ``(1 + weight)``, all in float32, then back to the input's dtype."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.weight.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def rope_for(cfg: ModelConfig, kind: str) -> RotaryEmbedding:
    """The RoPE table of one layer kind (``rope_parameters`` keyed by kind)."""
    raw = cfg.hf_config
    params = dict((raw.get("rope_parameters") or {}).get(kind) or {})
    default_theta = 10_000.0 if kind == SLIDING else 1_000_000.0
    theta = params.get("rope_theta") or (raw.get("rope_local_base_freq") if kind == SLIDING
                                         else raw.get("rope_theta")) or default_theta
    scaling = params if params.get("rope_type", "default") != "default" else None
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, float(theta), scaling)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        d, raw = cfg.dtype, cfg.hf_config
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim,
                                          cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias, dtype=d)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.attention_bias, dtype=d)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, d)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, d)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, backend)
        self.attn.scale = float(raw.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v, meta))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, dtype=cfg.dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                           dtype=cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        h, eps, d = cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype
        self.self_attn = Gemma3Attention(cfg, backend, rotary_emb)
        self.mlp = Gemma3MLP(cfg)
        self.input_layernorm = GemmaRMSNorm(h, eps, d)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, d)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, d)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, d)

    def forward(self, positions, hidden, meta):
        # Sandwich norms: each sublayer's output is normed before the residual add.
        attn = self.self_attn(positions, self.input_layernorm(hidden), meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.embed_scale = cfg.hidden_size ** 0.5
        types = cfg.hf_config.get("layer_types") or ["full_attention"] * cfg.num_hidden_layers
        ropes = {kind: rope_for(cfg, kind) for kind in set(types)}  # one table per kind
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, backend, ropes[kind])
                                    for kind in types)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, input_ids, positions, meta):
        # The scale rounded to the weights' dtype first, as the checkpoint was trained.
        scale = torch.tensor(self.embed_scale, dtype=self.embed_tokens.weight.dtype)
        hidden = self.embed_tokens(input_ids) * scale
        for layer in self.layers:
            hidden = layer(positions, hidden, meta)
        return self.norm(hidden)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        if cfg.quantization is not None:
            raise ValueError(f"quantization={cfg.quantization!r} is not supported for "
                             "Gemma3ForCausalLM; use quantization=None")
        if cfg.hf_config.get("attn_logit_softcapping"):
            raise ValueError("attn_logit_softcapping="
                             f"{cfg.hf_config['attn_logit_softcapping']!r} in config.json is "
                             "not supported (no attention backend soft-caps scores); "
                             "allowed: null")
        self.config = cfg
        self.model = Gemma3Model(cfg, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap: Optional[float] = cfg.hf_config.get("final_logit_softcapping")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        logits = self.lm_head.compute_logits(hidden)
        if logits is not None and self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
