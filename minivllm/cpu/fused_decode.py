"""A Llama-family decode step in one C++ call (``csrc/llama_decode.cpp``), replayed
by the model runner: Llama, Mistral, Qwen2, Qwen3 (q/k norm), Gemma 3, and the
mixtures of experts Qwen3-MoE, Mixtral and Qwen2-MoE.

In eager PyTorch every operator of a decode step costs twice on a CPU: the
kernel, and the Python around it (the module call, the argument checks, the
dispatcher). A decode step of a small model runs a few hundred such
operators. vLLM removes that cost on GPUs by capturing the step once as a
CUDA graph and replaying it from the model runner; here the layer loop is
written out in C++ over the same kernels the twins call (``layers.py``), with
the same weights in the same order, so a step gives bit for bit the hidden
states and logits of the Python layers.

A float32 step is a single OpenMP parallel region: the threads split each
kernel's work between them (output columns of the products, (sequence, KV
head) items of attention) and meet at a barrier that spins, so they never go
to sleep between two of the step's kernels. With more than one sequence,
SiLU-and-mul is the gate/up product's epilogue when that weight's panels
pair gate and up columns (``PackedWeight.halves``). The LM head runs in the
same call. A step with LoRA tokens stays one call too: each linear's delta is
added right after its product by the same BGMV kernels the layers' hook
calls (``cpu/lora.py``), from the adapters' stacked factors and the step's
token slots.

Quantized linear layers (``quantization="gguf"`` or ``"q8_0"``, one block
type a layer) join the loop with their blocks: their products are
``gguf_gemm.cpp``'s kernels, as ``CpuQuantizedLinearMethod`` calls them, so
the tokens are those of the quantized layers.

A step in which every sequence brings a few new tokens after its cached context
(a beam's partly filled last block, recomputed over the prefix cache; the tail of
a chunked prompt) is replayed too: each new token becomes a one-token sequence
over its sequence's block table that sees the keys up to its own position.
Every layer writes all the step's keys before any attention reads them, so a
token sees the new tokens before it, as causal attention does.

The family's variants run in the same loop. Qwen3's q/k norm: each head of q
and k normed before RoPE, by the RMSNorm kernel over rows of head_dim (the
layers' twin, ``layers.CpuHeadRMSNorm``, does the same). Gemma 3 (a hybrid:
sliding-window and global layers): its (1 + w) norms with 1 + w folded into a
float32 weight for the same kernel (``cpu/gemma3.py``'s twins, float32 only),
its q/k norms, its sandwich norms (each sublayer's output normed before the
residual add), GeGLU (``gelu_tanh_and_mul``, the twin's kernel too), the
embedding's scale and the final logits' soft cap (here, in Python, with the
model's operators), a RoPE table per layer kind, and its KV cache groups: each
layer reads and writes its group's block table and slots, a sliding group's
layers only the window's keys (``worker/kv_cache_groups.py`` makes a metadata per
group). The replay's numbers are the twins' Python layers', bit for bit; the
twins' against the reference layers (``cpu_kernels=False``) differ by float32
rounding.

A mixture of experts' sparse layers (``fused_decode_moe.py``, ``csrc/moe_decode.cpp``)
run their router, the route (softmax in float32, top-k, renormalisation), the
experts' one call (``cpu/fused_moe.py``'s ``moe_expert_sum``, float32 or bfloat16
stacks or Q8_0 blocks) and Qwen2-MoE's gated shared expert with the twins' operators
in the twins' order, and count each expert's pairs into its ``expert_load``. A
float32 step leaves its parallel region for each sparse layer's MLP (the experts
share out their own work) and starts the next region at the next layer.

The runner replays a step only when that equality holds: CPU float32 or
bfloat16 weights packed (``prepack.py``) or quantized, one rank, every norm and
MLP on its kernel twin (so not Gemma 3 in bfloat16), attention layers of the
full and sliding kinds, the ``cpu`` attention backend, and a decode step (one
new token per sequence) or at most ``MAX_DECODE_QUERY`` new tokens per sequence
each after cached context (the CPU attention's decode rows). Everything else —
prompts, longer chunks, tensor parallelism, expert parallelism, latent
attention, linear attention — runs the model. The weights are captured when it
is built; if the layers are repacked later it notices and stands aside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from minivllm import envs
from minivllm.cpu import _custom_ops as ops
from minivllm.cpu.attention import MAX_DECODE_QUERY
from minivllm.cpu.fused_decode_moe import (is_moe, moe_config, moe_linears, moe_problem,
                                           moe_tensors)
from minivllm.cpu.prepack import PANEL_MAX_ROWS
from minivllm.cpu.quantized import CpuQuantizedLinearMethod
from minivllm.model.attention import AttentionMetadata
from minivllm.model.layers.parallel import tp_size
from minivllm.model.layers.quantization import BLOCK_TYPES
from minivllm.model.layers.quantization.int8_activations import INT8_TYPES

if TYPE_CHECKING:
    from minivllm.lora.model_manager import LoRAMapping

ENV_SWITCH = envs.name_of("FUSED_DECODE")
NONE = torch.empty(0)  # "no bias" (or no such layer) in the flat weight lists


def fused_decode_enabled() -> bool:
    return envs.MINIVLLM_FUSED_DECODE


def _quantized(layer: nn.Module) -> bool:
    return getattr(layer, "quant_method", None) is not None


def linear_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """weight, float32 panels, bias, the GEMM library's packed copy (as the C++ reads them);
    for quantized blocks: the blocks, no panels, bias, and [GGML type id, 1 if its x is
    quantized to int8 (activation_dtype="int8")]."""
    bias = getattr(layer, "bias", None)  # (an LM head has none)
    bias = bias if bias is not None else NONE
    if _quantized(layer):
        (_, t), = layer.qweight.segments
        int8 = layer.quant_method.config.activation_dtype == "int8" and t.qtype in INT8_TYPES
        return [t.data, NONE, bias, torch.tensor([BLOCK_TYPES[t.qtype].type_id, int(int8)])]
    packed = layer.packed_weight
    panels = packed.panels if packed.panels is not None else NONE
    return [layer.weight, panels, bias, packed.gemm]


def _layer_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """One decoder layer's tensors in the order llama_decode.cpp reads them (a mixture
    of experts' gate_up and down empty: its tensors are fused_decode_moe.py's)."""
    attn, mlp = layer.self_attn, layer.mlp
    mlp_tensors = ([NONE] * 8 if is_moe(mlp) else
                   linear_tensors(mlp.gate_up_proj) + linear_tensors(mlp.down_proj))
    return ([layer.input_layernorm.kernel_weight()] + linear_tensors(attn.qkv_proj)
            + linear_tensors(attn.o_proj) + [layer.post_attention_layernorm.kernel_weight()]
            + mlp_tensors)


# The norms a layer may have besides input_layernorm and post_attention_layernorm,
# in llama_decode.cpp's layer_norms order: q/k norm (Qwen3, Gemma 3), then Gemma 3's
# sandwich norms around the MLP.
_HEAD_NORMS = ("q_norm", "k_norm")
_SANDWICH_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def _layer_norms(layer: nn.Module) -> list[torch.Tensor]:
    """A layer's q/k norms (none, or q and k) and sandwich norms, as the kernel's weights."""
    attn = layer.self_attn
    if attn.q_norm is None:
        return []
    out = [attn.q_norm.kernel_weight(), attn.k_norm.kernel_weight()]
    if hasattr(layer, _SANDWICH_NORMS[0]):
        out += [getattr(layer, name).kernel_weight() for name in _SANDWICH_NORMS]
    return out


def _norms(model: nn.Module) -> dict[str, nn.Module]:
    """Every RMSNorm the C++ loop runs, by name."""
    out = {"norm": model.norm}
    names = ("input_layernorm", "post_attention_layernorm") + _SANDWICH_NORMS
    for i, layer in enumerate(model.layers):
        out.update({f"layers.{i}.{n}": getattr(layer, n) for n in names if hasattr(layer, n)})
        out.update({f"layers.{i}.self_attn.{n}": getattr(layer.self_attn, n)
                    for n in _HEAD_NORMS if getattr(layer.self_attn, n, None) is not None})
    return out


def _embedding_blocks(embed: nn.Module) -> Optional[tuple[torch.Tensor, int, int]]:
    """A quantized embedding's blocks, GGML type id and columns, when one segment holds
    them (else None: the module looks rows up). The C++ dequantization of a step's rows
    gives the reference's numbers (tests/test_quantization.py checks that); it spares a
    one-stream step the embedding's small PyTorch operators."""
    if not _quantized(embed) or len(embed.qweight.segments) != 1:
        return None
    (_, t), = embed.qweight.segments
    return t.data, BLOCK_TYPES[t.qtype].type_id, t.cols


def _lora_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Each linear's LoRA factors (lora_a, lora_b: ``cpu/lora.py``'s twin, its B stored
    [slots, R, out]) in the order llama_decode.cpp reads them; [] without LoRA (and
    for a mixture of experts, whose routers have none)."""
    layers = [getattr(lin, "lora_layer", None) for lin in _linears(model)]
    if any(layer is None for layer in layers):
        return []
    return [t for layer in layers for t in (layer.lora_a, layer.lora_b)]


def _linears(model: nn.Module) -> list[nn.Module]:
    """Every linear layer of the decoder layers (a mixture of experts': its router and
    shared expert), attention's first."""
    return [lin for layer in model.layers
            for lin in ([layer.self_attn.qkv_proj, layer.self_attn.o_proj]
                        + _mlp_linears(layer.mlp))]


def _mlp_linears(mlp: nn.Module) -> list[nn.Module]:
    return moe_linears(mlp) if is_moe(mlp) else [mlp.gate_up_proj, mlp.down_proj]


def _dense_mlps(model: nn.Module) -> list[nn.Module]:
    """The MLPs that are not a mixture of experts (the shared experts included)."""
    return [m for layer in model.layers
            for m in ([getattr(layer.mlp, "shared_expert", None)] if is_moe(layer.mlp)
                      else [layer.mlp])
            if m is not None]


def fused_decode_problem(causal_lm: nn.Module) -> Optional[str]:
    """Why ``causal_lm`` (a LlamaForCausalLM) cannot be replayed so, or None."""
    if not fused_decode_enabled():
        return f"turned off by {ENV_SWITCH}=0"
    model = causal_lm.model
    kinds = set(getattr(getattr(causal_lm, "config", None), "layer_types", None) or ())
    if kinds - _ATTENTION_KINDS:
        return (f"layers of kinds {sorted(kinds - _ATTENTION_KINDS)} are not in the C++ loop "
                f"(it takes {sorted(_ATTENTION_KINDS)})")
    first = model.layers[0]
    if not hasattr(first.self_attn, "qkv_proj"):  # models/deepseek_v3.py
        return "latent attention (MLA) layers are not in the C++ loop"
    linears = _linears(model) + [causal_lm.lm_head]
    for lin in filter(_quantized, linears):
        if len(lin.qweight.segments) != 1:
            return (f"a quantized weight in {len(lin.qweight.segments)} segments of types "
                    f"{lin.qweight.qtypes} (the C++ loop takes one type a layer)")
        if not isinstance(lin.quant_method, CpuQuantizedLinearMethod):
            return "quantized layers without the CPU kernels' method (swap_in_quantized)"
    if first.input_layernorm.weight.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {first.input_layernorm.weight.dtype} (float32 and bfloat16 only)"
    if first.input_layernorm.weight.device.type != "cpu":
        return "not on the CPU"
    problem = moe_problem(causal_lm, first.input_layernorm.weight.dtype)
    if problem is not None:
        return problem
    if tp_size() != 1:
        return "tensor parallelism (the C++ loop has no all-reduce)"
    untwinned = {name: norm for name, norm in _norms(model).items()
                 if not hasattr(norm, "kernel_weight")}
    if untwinned:
        name, norm = next(iter(untwinned.items()))
        return (f"norm {name} ({type(norm).__name__}, {norm.weight.dtype}) runs without a "
                "kernel twin (the C++ loop repeats the twins' arithmetic; cpu/gemma3.py "
                "twins float32 only)")
    for mlp in _dense_mlps(model):
        if not (hasattr(mlp, "gelu") or hasattr(mlp, "act_fn")):
            return f"MLP {type(mlp).__name__} runs without its kernel twin (cpu/gemma3.py)"
    if first.self_attn.attn.backend.name != "cpu":
        return f"attention backend {first.self_attn.attn.backend.name!r} (needs 'cpu')"
    if first.self_attn.rotary_emb.cos_cache.dtype != torch.float32:
        return "the RoPE tables are not float32 (the C++ RoPE kernel needs them so)"
    if any(getattr(lin, "packed_weight", None) is None
           for lin in linears if not _quantized(lin)):
        return (f"linear weights are not prepacked ({envs.name_of('CPU_PREPACK')}=0, or a "
                "dtype this CPU cannot pack)")
    if len({_halves(mlp.gate_up_proj) for mlp in _dense_layer_mlps(model)}) > 1:
        return "gate_up weights packed in two layouts (the C++ loop takes one for all)"
    return ops.build_problem()  # last: it may compile the kernels


# Attention layer kinds (config.layer_types) the C++ loop runs: a sliding layer
# reads its KV cache group's table from its window's first block on.
_ATTENTION_KINDS = {"full_attention", "sliding_attention"}


def _dense_layer_mlps(model: nn.Module) -> list[nn.Module]:
    """The layers' own dense MLPs (the ones the C++ region runs; not shared experts)."""
    return [layer.mlp for layer in model.layers if not is_moe(layer.mlp)]


def _halves(gate_up: nn.Module) -> bool:
    """gate_up's panels pair gate and up columns (quantized blocks have no panels)."""
    return not _quantized(gate_up) and gate_up.packed_weight.halves


def _is_pure_prefill(meta: AttentionMetadata) -> bool:
    """No sequence has cached context: every query attends only to itself."""
    q = meta.query_start_loc_cpu
    return all(q[i + 1] - q[i] == s for i, s in enumerate(meta.seq_lens_cpu))


def _all_after_context(meta: AttentionMetadata) -> bool:
    """Every sequence's new tokens follow cached context, at most MAX_DECODE_QUERY of
    them: the Python layers' attention takes them as decode rows too."""
    q = meta.query_start_loc_cpu
    return meta.max_query_len <= MAX_DECODE_QUERY and all(
        0 < q[i + 1] - q[i] < s for i, s in enumerate(meta.seq_lens_cpu))


def _per_token(meta: AttentionMetadata, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables and lengths with each new token as a sequence of its own: its
    sequence's table, the keys up to its position."""
    if meta.max_query_len == 1:
        return meta.block_tables.to(torch.int32), meta.seq_lens.to(torch.int32)
    q = meta.query_start_loc_cpu
    counts = torch.tensor([q[i + 1] - q[i] for i in range(meta.num_seqs)])
    return (meta.block_tables.to(torch.int32).repeat_interleave(counts, dim=0),
            (positions + 1).to(torch.int32))


class LlamaFusedDecode:
    """Replays a LlamaForCausalLM's pure decode steps through ``llama_decode_forward``."""

    def __init__(self, causal_lm: nn.Module) -> None:
        model = self.model = causal_lm.model
        self.weights = [t for layer in model.layers for t in _layer_tensors(layer)]
        # The variants (llama_decode.cpp): q/k norm and Gemma 3's sandwich norms, GeGLU.
        self.layer_norms = [t for layer in model.layers for t in _layer_norms(layer)]
        dense = _dense_layer_mlps(model)
        self.gelu = bool(dense) and hasattr(dense[0], "gelu")
        # A mixture of experts' layers (fused_decode_moe.py): their routers, experts and
        # shared experts, and the expert load counters the C++ adds each step's pairs to.
        sparse = [(i, layer.mlp) for i, layer in enumerate(model.layers) if is_moe(layer.mlp)]
        self.moe_weights = [t for _, block in sparse for t in moe_tensors(block, linear_tensors)]
        self.moe_config = [n for i, block in sparse for n in moe_config(i, block, _halves)]
        self.expert_loads = [block.experts.expert_load for _, block in sparse]
        self.final_norm = model.norm.kernel_weight()
        # Gemma 3: the embedding's scale (in the weights' dtype, as its forward
        # rounds it) and the final logits' soft cap, both applied here in Python
        # with the model's own operators.
        scale = getattr(model, "embed_scale", None)
        self.embed_scale = (None if scale is None
                            else torch.tensor(scale, dtype=model.embed_tokens.weight.dtype))
        self.softcap = getattr(causal_lm, "softcap", None)
        # One RoPE table per layer kind (Gemma 3's local and global bases): the
        # distinct tables and each layer's, or none where all layers share one.
        rotaries = [layer.self_attn.rotary_emb for layer in model.layers]
        distinct = list({id(r): r for r in rotaries}.values())
        self.ropes = ([] if len(distinct) == 1
                      else [t for r in distinct for t in (r.cos_cache, r.sin_cache)])
        self.layer_ropes = ([] if len(distinct) == 1
                            else [next(j for j, d in enumerate(distinct) if d is r)
                                  for r in rotaries])
        self.layer_groups: list[int] = []  # each layer's KV cache group (_caches_bound)
        self.packed = [getattr(lin, "packed_weight", None) for lin in _linears(model)]
        self._first_qkv = model.layers[0].self_attn.qkv_proj
        # gate_up's panels pair gate and up columns (every layer packed alike):
        # the C++ step then applies SiLU-and-mul in that product's epilogue.
        self.gate_up_halves = bool(dense) and all(_halves(mlp.gate_up_proj) for mlp in dense)
        # The adapters' stacked factors (the same tensors the LoRA hooks read, filled
        # in place as slots load): a step with LoRA tokens adds each linear's delta
        # right after its product, with the same kernels as the hook.
        self.lora_weights = _lora_tensors(model)
        self.lm_head = causal_lm.lm_head
        self.compute_logits = causal_lm.compute_logits
        self.head_tensors = linear_tensors(self.lm_head)
        self.head_packed = getattr(self.lm_head, "packed_weight", None)
        first = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim, self.scale = first.head_dim, first.attn.scale
        self.eps = model.norm.eps
        self.rotary = first.rotary_emb
        self.embed_blocks = _embedding_blocks(model.embed_tokens)
        self.steps = 0  # decode steps replayed (the tests check the path is used)
        self.lora_steps = 0  # of which with LoRA tokens
        self.multi_token_steps = 0  # of which with several new tokens a sequence
        self._caches: Optional[tuple[list, list]] = None
        self._first_attn = first.attn

    def accepts(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor, lora: Optional[LoRAMapping] = None) -> bool:
        """A decode step, or a few new tokens per sequence after cached context, with
        the weights captured (and, for a step with LoRA tokens, every linear's factors)."""
        # Not a pure prefill: the C++ loop reads every sequence back through its
        # block table, which one-token prompts without cache slots lack
        # (AttentionMetadata.for_prefill); the model attends to them directly.
        if isinstance(meta, list):  # a metadata per KV cache group: the same sequences
            meta = meta[0]
        if meta.seq_lens_cpu is None or meta.query_start_loc_cpu is None:
            return False
        shape_ok = (not _is_pure_prefill(meta) if meta.max_query_len == 1
                    else _all_after_context(meta))
        return (shape_ok and logits_indices.numel() > 0 and self._caches_bound()
                and self._weights_current() and (lora is None or bool(self.lora_weights)))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, lora: Optional[LoRAMapping] = None,
                 logits_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The logits [len(logits_indices), vocab_size] of an accepted step (None:
        every row's)."""
        # The sampled rows are distinct and in order: as many as tokens means all,
        # and the LM head runs in the call; else on the sampled rows after it.
        if logits_indices is not None and logits_indices.numel() < input_ids.shape[0]:
            hidden = self._run(input_ids, positions, meta, lora, head=False)
            return self.compute_logits(hidden[logits_indices])
        logits = self._run(input_ids, positions, meta, lora, head=True)[:, :self.lm_head.vocab_size]
        if self.softcap:  # Gemma3ForCausalLM.compute_logits's operators
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata,
                      lora: Optional[LoRAMapping] = None) -> torch.Tensor:
        """The final hidden states [T, hidden] (what the model's forward returns)."""
        return self._run(input_ids, positions, meta, lora, head=False)

    def _run(self, input_ids, positions, meta, lora, head: bool) -> torch.Tensor:
        k_caches, v_caches = self._caches
        if self.embed_blocks is not None:  # the step's rows of the blocks, dequantized in C++
            blocks, type_id, cols = self.embed_blocks
            hidden = ops.gguf_dequantize(blocks.index_select(0, input_ids), type_id, cols)
        else:
            hidden = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        self.steps += 1
        self.lora_steps += lora is not None
        groups = meta if isinstance(meta, list) else []  # a metadata per KV cache group
        meta = groups[0] if groups else meta
        self.multi_token_steps += meta.max_query_len > 1
        block_tables, seq_lens = _per_token(meta, positions)
        return ops.llama_decode_forward(
            hidden, positions, meta.slot_mapping, block_tables,
            seq_lens, self.rotary.cos_cache, self.rotary.sin_cache,
            k_caches, v_caches, self.weights, self.final_norm, self.num_heads,
            self.num_kv_heads, self.head_dim, self.eps, self.scale, PANEL_MAX_ROWS,
            self.head_tensors if head else [],
            self.head_packed.panel_max_rows if head and self.head_packed else 0, self.gate_up_halves,
            self.lora_weights if lora is not None else [],
            lora.token_lora_indices if lora is not None else None,
            self.layer_norms, self.gelu,
            [t for m in groups for t in (_per_token(m, positions)[0], m.slot_mapping)],
            [m.sliding_window or 0 for m in groups], self.layer_groups if groups else [],
            self.ropes, self.layer_ropes, self.moe_weights, self.moe_config,
            self.expert_loads)

    def _caches_bound(self) -> bool:
        """The attention layers' KV caches (re-read when the runner rebinds them)."""
        # Checked every step: one identity test, not a walk over the layers.
        first = self._first_attn.k_cache
        if self._caches is None or self._caches[0][0] is not first:
            if first is None:
                return False
            attn = [layer.self_attn.attn for layer in self.model.layers]
            self._caches = ([a.k_cache for a in attn], [a.v_cache for a in attn])
            groups = [a.kv_cache_group for a in attn]
            self.layer_groups = [] if None in groups else groups
        return True

    def _weights_current(self) -> bool:
        # Repacking makes new PackedWeight objects; then our captured panels are stale.
        # (Read from the modules' __dict__, where prepack puts them: a missing
        # attribute through nn.Module.__getattr__ costs microseconds every step.)
        return (self._first_qkv.__dict__.get("packed_weight") is self.packed[0]
                and self.lm_head.__dict__.get("packed_weight") is self.head_packed)
