"""Qwen3-Next (text): gated DeltaNet layers with a few gated-attention layers.

``config.layer_types`` says which each decoder layer is (by default three
``linear_attention`` layers, then one ``full_attention``):

* a **linear_attention** layer (``GatedDeltaNet``) keeps no K/V per token. Per
  request it keeps a fixed-size state: a [d_k, d_v] matrix per value head (the
  gated delta rule's, ``minivllm/model/layers/gated_delta_rule.py``) and the last
  ``conv_kernel - 1`` inputs of a short causal convolution. The engine holds both
  in the KV cache pool (``LinearStateSpec`` in ``core/kv_cache_interface.py``): a
  block id of the layer's group is a row of its state tensors;
* a **full_attention** layer is attention with a sigmoid output gate (``q_proj``
  gives the query and the gate of each head), q/k RMSNorm, and RoPE on the first
  ``partial_rotary_factor`` of each head's dimensions only.

Every norm is RMSNorm times ``(1 + weight)`` as Gemma's, except the one inside a
linear layer (``weight * norm(x) * silu(z)``). The MLPs are mixtures of experts
with a gated shared expert (``models/moe.py``'s ``SparseMoeBlock``), or dense on
the layers in ``mlp_only_layers`` (all of them when ``num_experts`` is 0).

A sequence whose step starts at position 0 starts from zero state; any other
reads the state saved in the block of the token before its step (the previous
chunk's, the previous decode step's, or a prefix hit's last block). The step
saves the state after each block's last token in that block, so chunked prefill,
decode and prefix hits carry it, and a preempted request (recomputed from
position 0) starts over.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import ModelConfig
from minivllm.config.checks import bad
from minivllm.model.attention import Attention, AttentionBackend, AttentionMetadata
from minivllm.model.layers.gated_delta_rule import (causal_conv, chunk_gated_delta_rule,
                                                    prepare_qk, recurrent_gated_delta_rule)
from minivllm.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model.models.gemma3 import GemmaRMSNorm
from minivllm.model.models.llama import LlamaMLP
from minivllm.model.models.moe import MoEForCausalLM, SparseMoeBlock

LINEAR = "linear_attention"


class GatedAttention(nn.Module):
    """Attention whose output is scaled by sigmoid(gate), the gate from ``q_proj``."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        h, d, hd, bias = cfg.hidden_size, cfg.dtype, cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                            cfg.num_key_value_heads, hd)
        self.q_proj = ColumnParallelLinear(h, 2 * self.num_heads * hd, bias, d)
        self.k_proj = ColumnParallelLinear(h, self.num_kv_heads * hd, bias, d)
        self.v_proj = ColumnParallelLinear(h, self.num_kv_heads * hd, bias, d)
        self.o_proj = RowParallelLinear(self.num_heads * hd, h, bias, d)
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps, d)
        self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps, d)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, backend)

    def forward(self, positions, x, meta):
        q, gate = self.q_proj(x).view(-1, self.num_heads, 2 * self.head_dim).chunk(2, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        r = self.rotary_emb.cos_cache.shape[-1]  # only the first r dims of a head rotate
        q_rot, k_rot = self.rotary_emb(positions, q[..., :r], k[..., :r])
        q, k = torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)
        out = self.attn(q.flatten(1), k.flatten(1), self.v_proj(x), meta)
        return self.o_proj(out * torch.sigmoid(gate.flatten(1)))


class GatedDeltaNet(nn.Module):
    """A linear-attention layer: projections, causal conv, gated delta rule, gated norm.

    The model runner binds ``conv_state`` [num_blocks, conv_dim, K - 1] and
    ``ssm_state`` [num_blocks, H_v, d_k, d_v] (float32), ``kv_cache_group`` and
    ``block_size``. Block ``i`` of a request's table (in this layer's group) holds the
    state after the last of its tokens computed so far: the running state in the last
    block, a checkpoint at each full block's end (what a prefix hit resumes from)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        raw, h, d = cfg.hf_config, cfg.hidden_size, cfg.dtype
        self.hk, self.hv = raw["linear_num_key_heads"], raw["linear_num_value_heads"]
        self.dk, self.dv = raw["linear_key_head_dim"], raw["linear_value_head_dim"]
        self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv
        kernel = raw.get("linear_conv_kernel_dim", 4)
        self.in_proj_qkvz = ColumnParallelLinear(h, self.conv_dim + self.hv * self.dv, False, d)
        self.in_proj_ba = ColumnParallelLinear(h, 2 * self.hv, False, d)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim,
                                bias=False, dtype=d)
        self.dt_bias = nn.Parameter(torch.ones(self.hv, dtype=d))
        self.A_log = nn.Parameter(torch.zeros(self.hv, dtype=d))
        self.norm_weight_eps = cfg.rms_norm_eps
        self.norm = nn.Module()  # (holds only the gated norm's weight, by HF's name)
        self.norm.weight = nn.Parameter(torch.ones(self.dv, dtype=d))
        self.out_proj = RowParallelLinear(self.hv * self.dv, h, False, d)
        self.conv_state = self.ssm_state = self.kv_cache_group = self.block_size = None

    def split(self, x: torch.Tensor):
        """The checkpoint's layout: per key head, [q, k, v of its value heads, z]; then
        [b, a] of its value heads. Returns the conv input [T, conv_dim], z [T, Hv, dv],
        b and a [T, Hv]."""
        T, r = x.shape[0], self.hv // self.hk
        q, k, v, z = self.in_proj_qkvz(x).view(T, self.hk, -1).split(
            [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(T, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
        return mixed, z.reshape(T, self.hv, self.dv), b.reshape(T, -1), a.reshape(T, -1)

    def heads(self, y: torch.Tensor):
        """Conv output [..., conv_dim] -> q, k [..., Hv, dk] (a key head per r value
        heads), v [..., Hv, dv]."""
        q, k, v = y.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], -1)
        r = self.hv // self.hk
        q, k = (t.unflatten(-1, (self.hk, self.dk)).repeat_interleave(r, -2) for t in (q, k))
        q, k = prepare_qk(q, k)
        return q, k, v.unflatten(-1, (self.hv, self.dv))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        meta = meta[self.kv_cache_group]
        mixed, z, b, a = self.split(x)
        # (beta rounded to the model's dtype as Hugging Face's; in bfloat16 the tokens
        # follow theirs only where the rounding points are theirs: chapter 24)
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = torch.empty(x.shape[0], self.hv, self.dv, dtype=torch.float32, device=x.device)
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        decodes = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1 < lens[s]]
        for s in sorted(set(range(len(lens))) - set(decodes)):  # prefill chunks, one each
            lo, hi = starts[s], starts[s + 1]
            out[lo:hi] = self.prefill(mixed[lo:hi], g[lo:hi], beta[lo:hi],
                                      meta.block_tables[s].tolist(), lens[s] - (hi - lo))
        if decodes:
            tok, out[tok] = self.decode(mixed, g, beta, meta.block_tables, starts, lens, decodes)
        return self.out_proj(self.gated_norm(out.to(x.dtype), z).flatten(1))

    def prefill(self, mixed, g, beta, table: list[int], start: int) -> torch.Tensor:
        """One sequence's chunk from position ``start``, a block's tokens at a time: the
        state after each block's last token is saved in that block's row."""
        bs, weight = self.block_size, self.conv1d.weight[:, 0]
        conv, state = None, mixed.new_zeros(self.ssm_state.shape[1:], dtype=torch.float32)
        if start > 0:  # the state after token start - 1, in that token's block
            row = table[(start - 1) // bs]
            conv, state = self.conv_state[row], self.ssm_state[row].clone()
        out, pos = [], start
        while pos < start + len(mixed):
            end = min((pos // bs + 1) * bs, start + len(mixed))  # to the block's end
            y, conv = causal_conv(mixed[pos - start:end - start], conv, weight)
            q, k, v = self.heads(y)
            out.append(chunk_gated_delta_rule(q, k, v, g[pos - start:end - start],
                                              beta[pos - start:end - start], state))
            row = table[(end - 1) // bs]
            self.conv_state[row], self.ssm_state[row] = conv, state
            pos = end
        return torch.cat(out)

    def decode(self, mixed, g, beta, tables, starts, lens, decodes):
        """One token for each decoding sequence, all at once: the conv window slides by
        one, the state takes one step, read from the previous token's block's row and
        written to this token's. Returns the tokens' rows and their outputs."""
        tok = torch.tensor([starts[s] for s in decodes], device=mixed.device)
        pos = torch.tensor([lens[s] - 1 for s in decodes], device=mixed.device)
        seqs = torch.tensor(decodes, device=mixed.device)
        src = tables[seqs, (pos - 1) // self.block_size].long()
        dst = tables[seqs, pos // self.block_size].long()
        window = torch.cat((self.conv_state[src], mixed[tok, :, None]), dim=-1)  # [B, C, K]
        self.conv_state[dst] = window[..., 1:]
        # One rounding of the conv's sum, as a conv1d's (a half-precision sum of
        # half-precision products rounded at each term, and parted from HF's in bfloat16)
        y = F.silu((window.float() * self.conv1d.weight[:, 0].float()).sum(-1).to(mixed.dtype))
        q, k, v = self.heads(y[:, None])
        state = self.ssm_state[src]
        out = recurrent_gated_delta_rule(q, k, v, g[tok, None], beta[tok, None], state)
        self.ssm_state[dst] = state
        return tok, out[:, 0]

    def gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """weight * RMSNorm(o) * silu(z), per value head."""
        o = o.float()  # (the delta rule's output rounded to the model's dtype, then float32)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_weight_eps)
        o = self.norm.weight * o.to(z.dtype)
        return (o * F.silu(z.float())).to(z.dtype)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, kind: str,
                 rotary_emb: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        h, eps, d = cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg, backend, rotary_emb)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(h, eps, d)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, d)

    def forward(self, positions, hidden, meta):
        x = self.input_layernorm(hidden)
        mixed = (self.linear_attn(x, meta) if self.kind == LINEAR
                 else self.self_attn(positions, x, meta))
        hidden = hidden + mixed
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        raw = cfg.hf_config
        rope = dict(raw.get("rope_parameters") or {})
        rotary_dim = int(cfg.head_dim * rope.get("partial_rotary_factor",
                                                 raw.get("partial_rotary_factor", 0.25)))
        rotary = RotaryEmbedding(rotary_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling)
        sparse = cfg.moe.sparse_layers if cfg.moe is not None else ()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(cfg, backend, kind, rotary,
                                  SparseMoeBlock(cfg) if i in sparse else LlamaMLP(cfg))
            for i, kind in enumerate(cfg.layer_types))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, meta)
        return self.norm(hidden)


class Qwen3NextForCausalLM(nn.Module):
    # q_proj holds queries and gates: not fused with k/v; only the MLPs' gate/up are.
    stacked_params = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    map_expert_name = staticmethod(MoEForCausalLM.map_expert_name)
    # The experts' load per sparse layer (metrics, step trace), as for the other MoEs.
    expert_layers, expert_load = MoEForCausalLM.expert_layers, MoEForCausalLM.expert_load

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        if cfg.quantization is not None:
            raise bad("quantization", cfg.quantization,
                      "must be None for Qwen3NextForCausalLM: float weights only")
        act = cfg.hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise bad("hidden_act", act, "must be 'silu' for Qwen3NextForCausalLM")
        self.config = cfg
        self.model = Qwen3NextModel(cfg, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor):
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[nn.Module]:
        """Each decoder layer's cache user, by layer index: an ``Attention`` or a
        ``GatedDeltaNet`` (bound to its state rows by ``worker/kv_cache_groups.py``)."""
        return [layer.linear_attn if layer.kind == LINEAR else layer.self_attn.attn
                for layer in self.model.layers]


__all__ = ["Qwen3NextForCausalLM", "GatedDeltaNet", "GatedAttention"]
