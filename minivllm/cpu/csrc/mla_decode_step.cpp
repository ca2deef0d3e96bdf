// A whole pure decode step of a DeepSeek-V2/V3 model (multi-head latent
// attention, dense MLPs) in one call: the layer loop of
// minivllm/model/models/deepseek_v3.py with model/attention/mla.py's absorbed
// decode as cpu/mla.py runs it, written out in C++ over the same kernels.
//
// Why: a latent-attention layer runs about twice as many small operators as a
// Llama layer (the query's and the latent's splits, the rope halves, two
// products over heads, the cache row), each with its Python module call and
// dispatcher trip; at a few sequences that overhead outweighs the kernels.
// Here the loop calls the same tensor-level kernels and ATen operators, on
// the same views, in the same order, so a step gives bit for bit the Python
// layers' hidden states and logits; only the Python around them is gone.
// (Unlike llama_decode.cpp's float32 step it is not one OpenMP region: each
// kernel keeps its own parallel loop.)
//
// The Python side (minivllm/cpu/fused_decode_mla.py) checks what this loop
// takes (dense MLPs, packed weights, one rank) and falls back to the layers
// otherwise.
#include <ATen/ATen.h>

#include <string>

#include "ops.h"

namespace minivllm {
namespace {

// Per layer, the flat weight list holds (fused_decode_mla.py's _layer_tensors):
//   input_layernorm, q_a_proj (4: empty without q_lora_rank), q_a_layernorm
//   (empty without), q_b_proj or q_proj (4), kv_a_proj_with_mqa (4),
//   kv_a_layernorm, kv_b_proj's weight, o_proj (4), post_attention_layernorm,
//   gate_up (4), down (4)
// where a linear layer's 4 are those llama_decode.cpp's linear() reads.
constexpr int64_t kInputNorm = 0, kQA = 1, kQANorm = 5, kQ = 6, kKVA = 10, kKVANorm = 14,
                  kKVB = 15, kO = 16, kPostNorm = 20, kGateUp = 21, kDown = 25,
                  kTensorsPerLayer = 29;

// A layer's attention widths (DeepseekV3Attention's).
struct Shape {
  int64_t heads, nope, rope, rank, v;  // heads, qk_nope/qk_rope/v head dims, kv_lora_rank
};

// What every layer of the step shares.
struct Step {
  at::Tensor positions, slot_mapping, block_tables, seq_lens, cos, sin;
  double eps, scale;
  int64_t panel_max_rows;
  bool interleave;  // rope_interleave: the rope dims come in pairs
};

// Pairs (x0, x1), (x2, x3), ... of the last dim -> halves (x0, x2, ..| x1, x3, ..).
at::Tensor deinterleave(const at::Tensor& t) {
  const int64_t r = t.size(-1);
  return at::cat({t.slice(-1, 0, r, 2), t.slice(-1, 1, r, 2)}, -1);
}

// The absorbed decode (cpu/mla.py's CpuMLAAttention.decode): W_UK folded into
// the query, attention over the latents, W_UV after -> [T, H * Dv].
at::Tensor absorbed_decode(const at::Tensor& q_nope, const at::Tensor& q_pe,
                           const at::Tensor& kv_b, const at::Tensor& cache, const Shape& s,
                           const Step& st) {
  const at::Tensor w_kv = kv_b.view({s.heads, s.nope + s.v, s.rank}).to(at::kFloat);
  const at::Tensor w_uk = w_kv.narrow(1, 0, s.nope), w_uv = w_kv.narrow(1, s.nope, s.v);
  const at::Tensor q_lat = at::bmm(q_nope.to(at::kFloat).transpose(0, 1), w_uk).transpose(0, 1);
  const at::Tensor q = at::cat({q_lat, q_pe.to(at::kFloat)}, -1).to(cache.scalar_type());
  const at::Tensor out =
      mla_decode_attention(q, cache, st.block_tables, st.seq_lens, s.rank, st.scale);
  return at::bmm(out.to(at::kFloat).transpose(0, 1), w_uv.transpose(1, 2))
      .transpose(0, 1)
      .to(q_nope.scalar_type())
      .flatten(1);
}

// DeepseekV3Attention.forward for a pure decode step, up to o_proj's input:
// x [T, E] (normed) -> [T, H * Dv]; the step's latent rows go into `cache`.
at::Tensor latent_attention(const at::Tensor& x, const at::Tensor* w, const at::Tensor& cache,
                            const Shape& s, const Step& st) {
  const int64_t T = x.size(0), pmr = st.panel_max_rows;
  const at::Tensor q =
      w[kQA].numel() > 0
          ? linear(rms_norm(linear(x, w + kQA, pmr), w[kQANorm], st.eps), w + kQ, pmr)
          : linear(x, w + kQ, pmr);
  const at::Tensor q3 = q.view({T, s.heads, s.nope + s.rope});
  const at::Tensor q_nope = q3.narrow(2, 0, s.nope);
  at::Tensor q_pe = q3.narrow(2, s.nope, s.rope);
  const at::Tensor kv = linear(x, w + kKVA, pmr);
  const at::Tensor latent = kv.narrow(1, 0, s.rank);
  at::Tensor k_pe = kv.narrow(1, s.rank, s.rope);
  if (st.interleave) {
    q_pe = deinterleave(q_pe);
    k_pe = deinterleave(k_pe);
  }
  // Dense copies: the RoPE kernel rotates them in place.
  q_pe = q_pe.contiguous();
  k_pe = k_pe.contiguous().unsqueeze(1);
  rotary_embedding(st.positions, q_pe, k_pe, st.cos, st.sin);
  // The cache row [normed latent, k_pe], written as one head's key and value.
  const at::Tensor row = at::cat({rms_norm(latent, w[kKVANorm], st.eps), k_pe.select(1, 0)}, -1)
                             .unsqueeze(1);
  const at::Tensor rows = cache.unsqueeze(2);
  reshape_and_cache(row, row, rows, rows, st.slot_mapping);
  return absorbed_decode(q_nope, q_pe, w[kKVB], cache, s, st);
}

}  // namespace

// hidden [T, E]: the step's token embeddings, one token per sequence (the
// residual stream, changed in place). caches: each layer's latent cache
// [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]; block_tables
// and seq_lens int32; cos_cache / sin_cache RotaryEmbedding's tables; dims:
// heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim.
// Returns the final norm's output [T, E], or with lm_head (a linear layer's
// 4 tensors) the logits.
at::Tensor mla_decode_forward(at::Tensor hidden, at::Tensor positions, at::Tensor slot_mapping,
                              at::Tensor block_tables, at::Tensor seq_lens, at::Tensor cos_cache,
                              at::Tensor sin_cache, at::TensorList caches, at::TensorList weights,
                              at::Tensor final_norm, at::IntArrayRef dims, bool interleave,
                              double eps, double scale, int64_t panel_max_rows,
                              at::TensorList lm_head, int64_t lm_head_panel_max_rows,
                              bool gate_up_halves) {
  const int64_t layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == layers * kTensorsPerLayer,
              "mla_decode_forward: weights must hold ", kTensorsPerLayer,
              " tensors per layer, one latent cache each (", layers, " caches: ",
              layers * kTensorsPerLayer, "), got ", weights.size());
  TORCH_CHECK(dims.size() == 5, "mla_decode_forward: dims must be [heads, qk_nope_head_dim, "
              "qk_rope_head_dim, kv_lora_rank, v_head_dim], got ", dims);
  TORCH_CHECK(lm_head.empty() || lm_head.size() == 4,
              "mla_decode_forward: lm_head must be empty or hold 4 tensors, got ", lm_head.size());
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == seq_lens.size(0) &&
                  hidden.size(0) == block_tables.size(0),
              "mla_decode_forward: hidden must be [sequences, hidden], one row per sequence, "
              "got ", hidden.sizes(), " for ", seq_lens.size(0), " sequences");
  const Shape s{dims[0], dims[1], dims[2], dims[3], dims[4]};
  const Step st{positions, slot_mapping, block_tables, seq_lens, cos_cache, sin_cache,
                eps, scale, panel_max_rows, interleave};
  at::Tensor residual = hidden, h;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kTensorsPerLayer;
    TORCH_CHECK(caches[i].dim() == 3 && caches[i].size(2) == s.rank + s.rope,
                "mla_decode_forward: layer ", i, "'s cache must be [num_blocks, block_size, ",
                s.rank + s.rope, "], got ", caches[i].sizes());
    // Pre-norm residual blocks; the residual add is fused into the next norm.
    at::Tensor x = i == 0 ? rms_norm(hidden, w[kInputNorm], eps)
                          : fused_add_rms_norm(h, residual, w[kInputNorm], eps);
    h = linear(latent_attention(x, w, caches[i], s, st), w + kO, panel_max_rows);
    x = fused_add_rms_norm(h, residual, w[kPostNorm], eps);
    h = linear(silu_and_mul(linear(x, w + kGateUp, panel_max_rows, gate_up_halves)),
               w + kDown, panel_max_rows);
  }
  at::Tensor out = fused_add_rms_norm(h, residual, final_norm, eps);
  return lm_head.empty() ? out : linear(out, lm_head.data(), lm_head_panel_max_rows);
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("mla_decode_forward(Tensor(a!) hidden, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor cos_cache, Tensor sin_cache, "
        "Tensor(b!)[] caches, Tensor[] weights, Tensor final_norm, int[] dims, bool interleave, "
        "float eps, float scale, int panel_max_rows, Tensor[] lm_head, "
        "int lm_head_panel_max_rows, bool gate_up_halves) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("mla_decode_forward", &minivllm::mla_decode_forward);
}

// oneDNN's packed bfloat16 weights are MkldnnCPU tensors (as in llama_decode.cpp).
TORCH_LIBRARY_IMPL(minivllm, MkldnnCPU, m) {
  m.impl("mla_decode_forward", &minivllm::mla_decode_forward);
}
