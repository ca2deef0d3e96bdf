"""A DeepSeek-V2/V3 decode step (multi-head latent attention) in one C++ call
(``csrc/mla_decode_step.cpp``), replayed by the model runner as the Llama's is
(``fused_decode.py``).

A latent-attention layer runs about twice the small operators of a Llama
layer: the query's split into its plain and rope parts, the rope halves, the
latent's norm, the cache row, the two batched products that fold ``W_UK``
into the query and apply ``W_UV`` after (``cpu/mla.py``). At a few sequences
their Python module calls and dispatcher trips cost more than the attention
kernel itself. The C++ loop calls the same kernels and ATen operators on the
same views in the same order, so a step gives bit for bit the hidden states
and logits of the Python layers; only the Python around them goes.

The runner replays a step only when that holds: dense MLPs in every layer
(a mixture of experts runs its router and experts in Python,
``cpu/fused_moe.py``), float32 or bfloat16 weights packed (``prepack.py``),
one rank, the layers' CPU twins (``cpu/mla.py``, float32 RoPE tables), and a
pure decode step that samples every sequence. Everything else runs the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from minivllm import envs
from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.fused_decode import ENV_SWITCH, NONE, fused_decode_enabled, linear_tensors
from minivllm.cpu.mla import CpuMLAAttention
from minivllm.cpu.prepack import PANEL_MAX_ROWS
from minivllm.model.attention import AttentionMetadata
from minivllm.model.layers.parallel import tp_size

if TYPE_CHECKING:
    from minivllm.lora.model_manager import LoRAMapping


def is_mla(causal_lm: nn.Module) -> bool:
    """A model whose layers attend with latents (``models/deepseek_v3.py``)."""
    layers = getattr(getattr(causal_lm, "model", None), "layers", None)
    return bool(layers) and hasattr(layers[0].self_attn, "kv_a_proj_with_mqa")


def _linear_tensors(layer: Optional[nn.Module]) -> list[torch.Tensor]:
    """``fused_decode.linear_tensors``; four empty tensors for a layer the model lacks
    (q_a_proj without q_lora_rank)."""
    return [NONE] * 4 if layer is None else linear_tensors(layer)


def _layer_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """One decoder layer's tensors in the order mla_decode_step.cpp reads them."""
    attn, mlp = layer.self_attn, layer.mlp
    lora_q = hasattr(attn, "q_a_proj")
    return (([layer.input_layernorm.weight] + _linear_tensors(getattr(attn, "q_a_proj", None))
             + [attn.q_a_layernorm.weight if lora_q else NONE]
             + _linear_tensors(attn.q_b_proj if lora_q else attn.q_proj))
            + _linear_tensors(attn.kv_a_proj_with_mqa)
            + [attn.kv_a_layernorm.weight, attn.kv_b_proj.weight]
            + _linear_tensors(attn.o_proj) + [layer.post_attention_layernorm.weight]
            + _linear_tensors(mlp.gate_up_proj) + _linear_tensors(mlp.down_proj))


def _linears(causal_lm: nn.Module) -> list[nn.Module]:
    names = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "o_proj")
    return ([getattr(layer.self_attn, n) for layer in causal_lm.model.layers for n in names
             if hasattr(layer.self_attn, n)]
            + [lin for layer in causal_lm.model.layers
               for lin in (layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            + [causal_lm.lm_head])


def _norms(causal_lm: nn.Module) -> list[nn.Module]:
    model = causal_lm.model
    return [model.norm] + [m for layer in model.layers for m in
                           (layer.input_layernorm, layer.post_attention_layernorm,
                            layer.self_attn.kv_a_layernorm,
                            getattr(layer.self_attn, "q_a_layernorm", None)) if m is not None]


def mla_decode_problem(causal_lm: nn.Module) -> Optional[str]:
    """Why ``causal_lm`` (a DeepSeek-V2/V3 model) cannot be replayed so, or None."""
    if not fused_decode_enabled():
        return f"turned off by {ENV_SWITCH}=0"
    layers = causal_lm.model.layers
    moe = [i for i, layer in enumerate(layers) if not hasattr(layer.mlp, "gate_up_proj")]
    if moe:
        return (f"mixture-of-experts layers ({len(moe)}, from layer {moe[0]}: DeepseekMoE) are "
                "not in the MLA C++ loop, only dense MLPs")
    first = layers[0]
    dtype = first.input_layernorm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 and bfloat16 only)"
    if first.input_layernorm.weight.device.type != "cpu":
        return "not on the CPU"
    if tp_size() != 1:
        return "tensor parallelism (the C++ loop has no all-reduce)"
    if any(type(layer.self_attn.attn) is not CpuMLAAttention for layer in layers):
        return "the MLA layers lack their CPU twin (cpu/mla.py)"
    if first.self_attn.rotary_emb.cos_cache.dtype != torch.float32:
        return "the RoPE tables are not float32 (the C++ RoPE kernel needs them so)"
    if any(getattr(lin, "packed_weight", None) is None for lin in _linears(causal_lm)):
        return (f"linear weights are not prepacked ({envs.name_of('CPU_PREPACK')}=0, or a "
                "dtype this CPU cannot pack)")
    if len({norm.eps for norm in _norms(causal_lm)}) > 1:
        return "RMSNorms with different eps (the C++ loop takes one)"
    if len({layer.mlp.gate_up_proj.packed_weight.halves for layer in layers}) > 1:
        return "gate_up weights packed in two layouts (the C++ loop takes one for all)"
    return ops.build_problem()


def _has_context(meta: AttentionMetadata) -> bool:
    """Some sequence has cached tokens (not a pure prefill of one-token prompts, whose
    sequences have no block tables: AttentionMetadata.for_prefill)."""
    q = meta.query_start_loc_cpu
    return any(q[i + 1] - q[i] != s for i, s in enumerate(meta.seq_lens_cpu))


class MLAFusedDecode:
    """Replays a DeepSeek model's pure decode steps through ``mla_decode_forward``."""

    def __init__(self, causal_lm: nn.Module) -> None:
        model = self.model = causal_lm.model
        self.weights = [t for layer in model.layers for t in _layer_tensors(layer)]
        self.packed = [lin.packed_weight for lin in _linears(causal_lm)]
        self._first = _linears(causal_lm)[0]
        first = model.layers[0].self_attn
        self.dims = [first.num_heads, first.nope, first.rope, first.kv_lora_rank,
                     first.v_head_dim]
        self.interleave, self.scale = first.interleave, first.attn.scale
        self.gate_up_halves = model.layers[0].mlp.gate_up_proj.packed_weight.halves
        self.lm_head = causal_lm.lm_head
        self.head_tensors = _linear_tensors(self.lm_head)
        self.eps, self.rotary = model.norm.eps, first.rotary_emb
        self.steps = 0  # decode steps replayed (the tests check the path is used)
        self._first_attn = first.attn
        self._caches: Optional[list[torch.Tensor]] = None

    def accepts(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor, lora: Optional[LoRAMapping] = None) -> bool:
        """A pure decode step that samples every sequence, without LoRA, with the
        weights captured (the conditions of ``LlamaFusedDecode.accepts``)."""
        return (lora is None and meta.max_query_len == 1
                and input_ids.shape[0] == meta.num_seqs
                and logits_indices.numel() == input_ids.shape[0]
                and meta.seq_lens_cpu is not None and meta.query_start_loc_cpu is not None
                and _has_context(meta) and self._caches_bound()
                and self._weights_current())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, lora: Optional[LoRAMapping] = None,
                 logits_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Every sequence's logits [T, vocab_size] of an accepted step (which samples
        every row: ``logits_indices`` is all of them)."""
        return self._run(input_ids, positions, meta, head=True)[:, :self.lm_head.vocab_size]

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata,
                      lora: Optional[LoRAMapping] = None) -> torch.Tensor:
        """The final hidden states [T, hidden] (what the model's forward returns)."""
        return self._run(input_ids, positions, meta, head=False)

    def _run(self, input_ids, positions, meta, head: bool) -> torch.Tensor:
        self.steps += 1
        return ops.mla_decode_forward(
            self.model.embed_tokens(input_ids), positions, meta.slot_mapping,
            meta.block_tables.to(torch.int32), meta.seq_lens.to(torch.int32),
            self.rotary.cos_cache, self.rotary.sin_cache, self._caches, self.weights,
            self.model.norm.weight, self.dims, self.interleave, self.eps, self.scale,
            PANEL_MAX_ROWS, self.head_tensors if head else [],
            self.lm_head.packed_weight.panel_max_rows if head else 0, self.gate_up_halves)

    def _caches_bound(self) -> bool:
        """The MLA layers' latent caches (re-read when the runner rebinds them)."""
        first = self._first_attn.kv_cache
        if self._caches is None or self._caches[0] is not first:
            if first is None:
                return False
            self._caches = [layer.self_attn.attn.kv_cache for layer in self.model.layers]
        return True

    def _weights_current(self) -> bool:
        # Repacking makes new PackedWeight objects; then the captured panels are stale.
        return (self._first.__dict__.get("packed_weight") is self.packed[0]
                and self.lm_head.__dict__.get("packed_weight") is self.packed[-1])


__all__ = ["MLAFusedDecode", "is_mla", "mla_decode_problem"]
