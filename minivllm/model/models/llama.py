"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm), one
implementation with three switches (``attention_bias``, ``qk_norm``,
``tie_word_embeddings``). It takes one flat batch of tokens (no padding) and returns
hidden states; ``compute_logits`` scores only the rows that sample."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.model.attention import Attention, AttentionBackend, AttentionMetadata
from minivllm.model.layers.activation import SiluAndMul
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                          RowParallelLinear)
from minivllm.model.layers.quantization import get_quantization_config
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding


def linear_quant_config(cfg: ModelConfig):
    """The linear layers' quantization (None: float weights)."""
    return get_quantization_config(cfg.quantization, cfg.activation_dtype)


def embedding_quant_config(cfg: ModelConfig):
    """The embedding's and LM head's: a GGUF's blocks; ``q8_0`` at load, as vLLM's
    ``fp8``, leaves them float."""
    return linear_quant_config(cfg) if cfg.quantization == "gguf" else None


def make_rotary_embedding(cfg: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                           cfg.rope_scaling)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 rotary_emb: Optional[RotaryEmbedding] = None) -> None:
        super().__init__()
        d, qc = cfg.dtype, linear_quant_config(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim,
                                          cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias, dtype=d, quant_config=qc)
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim,
                                        cfg.hidden_size, bias=False, dtype=d, quant_config=qc)
        self.rotary_emb = rotary_emb or make_rotary_embedding(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, d) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, d) if cfg.qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.flatten(1), k.flatten(1), v, meta)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        qc, size = linear_quant_config(cfg), intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size] * 2, dtype=cfg.dtype, quant_config=qc)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, dtype=cfg.dtype, quant_config=qc)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 rotary_emb: Optional[RotaryEmbedding] = None,
                 mlp: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = LlamaAttention(cfg, backend, rotary_emb)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = mlp or LlamaMLP(cfg)  # (a mixture of experts passes its own)

    def forward(self, positions, hidden, residual, meta):
        # Pre-norm residual blocks; the residual add is fused into the next norm.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, make_mlp=None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype,
                                                   embedding_quant_config(cfg))
        # One RoPE table for all layers: they rotate at the same positions, so
        # the step's cos/sin are looked up once, not once per layer.
        rotary_emb = make_rotary_embedding(cfg)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, rotary_emb, make_mlp and make_mlp(i))
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Hugging Face checkpoint names map onto these modules' names, with q/k/v and
    gate/up fused (``minivllm/model/loader.py`` does the loading)."""

    make_mlp = None  # layer index -> its MLP (None: LlamaMLP); models/moe.py sets it

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, backend, self.make_mlp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, cfg.dtype,
                                      embedding_quant_config(cfg))
        if cfg.tie_word_embeddings and self.lm_head.quant_method is not None:
            self.lm_head.qweight = self.model.embed_tokens.qweight
        elif cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Flat [T] token ids and positions -> final hidden states [T, hidden]. Each
        layer returns ``(hidden, residual)``, summing to the residual stream (chapter 3)."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Vocabulary scores of ``hidden``'s rows; with tensor parallelism they are
        gathered on rank 0 and the other ranks get None."""
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
