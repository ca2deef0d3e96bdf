"""DeepSeek-V3 and DeepSeek-V2 (text): the Llama skeleton with multi-head latent
attention and, from layer ``first_k_dense_replace`` on, a mixture of experts.

What differs from ``llama.py`` is the attention (``DeepseekV3Attention``):

* the query goes through a low-rank bottleneck when ``q_lora_rank`` is set
  (``q_a_proj`` -> RMSNorm -> ``q_b_proj``), else one ``q_proj``; each head's
  query is ``qk_nope_head_dim`` plain dimensions plus ``qk_rope_head_dim`` rotated;
* ``kv_a_proj_with_mqa`` makes, per token, a latent of ``kv_lora_rank`` (then
  RMSNorm) and one rope key of ``qk_rope_head_dim`` shared by all heads: that
  row is all the KV cache keeps (``MLAAttentionSpec``); ``kv_b_proj`` turns the
  latent into each head's key (no rope part) and value (``v_head_dim``);
* the softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``;
* with ``rope_interleave`` (DeepSeek-V3's default) the rope dimensions come in
  pairs ``(x0, x1), (x2, x3), ...``; they are de-interleaved first and rotated as
  Llama's halves, which gives the same dot products.

``minivllm/model/attention/mla.py`` attends: naive expansion for prefills, the
absorbed weights for decodes. Under tensor parallelism the heads split (``q_b_proj``,
``kv_b_proj`` by column, ``o_proj`` by row) and the latent, which has no heads, is
computed and cached whole on every rank, as in vLLM.

The MLP of layers ``first_k_dense_replace``.. (every ``moe_layer_freq``-th) is
``deepseek_moe.py``'s ``DeepseekMoE``: V3's sigmoid, bias-steered, group-limited router or
V2's softmax one (``RoutingSpec``, ``config/moe.py``), ``FusedMoE``'s experts (tensor and
expert parallel, the per-expert load in ``/metrics``, EPLB) and ungated
shared experts; the earlier layers keep a dense MLP of ``intermediate_size``.
DeepSeek-V2 (``DeepseekV2ForCausalLM``) is the same model with V2's router; its query
often skips the low-rank bottleneck (``q_lora_rank`` None). Hugging Face's V2 port
ignores ``norm_topk_prob``; minivllm applies it, as DeepSeek's own code and vLLM do.

Not run, and refused at load naming the field: RoPE scaling (YaRN); quantization.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.model.attention import AttentionBackend, AttentionMetadata
from minivllm.model.attention.mla import MLAAttention
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model.models.llama import (LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                         LlamaModel)
from minivllm.model.models.moe import MoEForCausalLM


def check_supported(cfg: ModelConfig) -> None:
    """Refuse at load what this file does not run, naming the config field."""
    if cfg.quantization is not None:
        raise ValueError(f"quantization={cfg.quantization!r} is not supported for "
                         f"{cfg.architecture}; use quantization=None")
    if cfg.rope_scaling is not None:
        raise ValueError(f"rope_scaling={cfg.rope_scaling!r} in config.json is not "
                         f"supported for {cfg.architecture}; allowed: none (rope_type "
                         "'default')")


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (vLLM's name): the latent's and the query's
    down-projections, whose outputs have no heads to split."""


class DeepseekV3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        raw, d, h = cfg.hf_config, cfg.dtype, cfg.hidden_size
        self.nope, self.rope = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
        self.kv_lora_rank, self.v_head_dim = raw["kv_lora_rank"], raw["v_head_dim"]
        self.interleave = raw.get("rope_interleave", True)
        qk_dim, heads, bias = self.nope + self.rope, cfg.num_attention_heads, cfg.attention_bias
        if raw.get("q_lora_rank"):
            self.q_a_proj = ReplicatedLinear(h, raw["q_lora_rank"], bias, d)
            self.q_a_layernorm = RMSNorm(raw["q_lora_rank"], cfg.rms_norm_eps, d)
            self.q_b_proj = ColumnParallelLinear(raw["q_lora_rank"], heads * qk_dim, dtype=d)
        else:
            self.q_proj = ColumnParallelLinear(h, heads * qk_dim, dtype=d)
        # The latent and rope key: replicated, every rank caches the whole row.
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.rope, bias, d)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps, d)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              heads * (self.nope + self.v_head_dim), dtype=d)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, h, bias=bias, dtype=d)
        self.num_heads = self.kv_b_proj.out_features // (self.nope + self.v_head_dim)
        self.rotary_emb = rotary_emb
        self.attn = MLAAttention(self.num_heads, self.nope, self.rope, self.v_head_dim,
                                 self.kv_lora_rank, qk_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope + self.rope).split(
            [self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        if self.interleave:  # pairs (x0, x1), ... -> halves, as the rotation expects
            q_pe, k_pe = (torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1) for t in (q_pe, k_pe))
        # Copies: the split views share x's storage, and a rotary layer may rotate in place.
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(), k_pe.contiguous()[:, None])
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, -1)
        out = self.attn(q_nope, q_pe, self.kv_a_layernorm(latent), k_pe[:, 0], w_kv, meta)
        return self.o_proj(out)


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (its ``forward``) around MLA and a dense or MoE MLP."""

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, layer: int = 0) -> None:
        nn.Module.__init__(self)  # Llama's __init__ would build Llama's attention
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = DeepseekV3Attention(cfg, rotary_emb)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = make_mlp(cfg, layer)


def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    if cfg.moe is None or layer not in cfg.moe.sparse_layers:
        return LlamaMLP(cfg)
    from minivllm.model.models.deepseek_moe import DeepseekMoE  # only with experts

    return DeepseekMoE(cfg)


class DeepseekV3Model(LlamaModel):
    """Llama's layer loop (its ``forward``) over DeepSeek layers."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        raw = cfg.hf_config
        rotary_emb = RotaryEmbedding(raw["qk_rope_head_dim"], cfg.max_position_embeddings,
                                     cfg.rope_theta)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(cfg, rotary_emb, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """Llama's head, logits and ``attention_layers`` (the ``MLAAttention`` of each layer)."""

    # The checkpoint's q_proj is DeepSeek's own (no fused qkv); gate/up are fused.
    stacked_params = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        check_supported(cfg)
        nn.Module.__init__(self)
        self.config = cfg
        self.model = DeepseekV3Model(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # The experts' names, their load and the collectives' bytes, as MoEForCausalLM's
    # (an empty list and dict where every layer is dense).
    map_expert_name = staticmethod(MoEForCausalLM.map_expert_name)
    expert_layers, expert_load = MoEForCausalLM.expert_layers, MoEForCausalLM.expert_load
    moe_dispatch_bytes = MoEForCausalLM.moe_dispatch_bytes


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2: the same layers; its router (softmax, greedy or group-limited
    greedy) comes from the config (``config/moe.py``)."""


__all__ = ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "check_supported"]
