// A whole decode step of a Llama-family model in one call: the layer loop of
// minivllm/model/models/llama.py, written out in C++ over the same kernels.
//
// Why: in eager PyTorch every operator of a decode step also costs a Python
// module call and a trip through the dispatcher, a few to a few dozen
// microseconds each. With ~10 operators a layer and 30 layers, that is
// several milliseconds a step: on the 2-core CPU, about a fifth of a
// single-stream step, in which the kernels themselves are short. Running
// the loop here removes that cost; the arithmetic is the same kernels in the
// same order, so the results are bit for bit those of the Python layers.
// (vLLM gets the same effect on GPUs by replaying a CUDA graph.)
//
// It covers pure decode steps (one new token per sequence) of float32
// models whose linear weights are packed for gemm.cpp; the Python side
// (minivllm/model/models/llama_fused_decode.py) checks that and falls back to the layers otherwise.
#include "cpu_types.h"
#include "ops.h"

namespace minivllm {
namespace {

// Per layer, the flat weight list holds, in this order:
//   input_layernorm, qkv (weight, panels, bias), o_proj (weight, panels, bias),
//   post_attention_layernorm, gate_up (weight, panels, bias), down (weight, panels, bias)
// An absent bias is an empty tensor. Keep in step with llama_fused_decode.py.
constexpr int64_t kTensorsPerLayer = 14;

// One linear layer: the single-row stream for one row, the panel GEMM else
// (the same choice as prepack.linear makes for these row counts).
at::Tensor linear(const at::Tensor& x, const at::Tensor* w) {
  c10::optional<at::Tensor> bias;
  if (w[2].numel() > 0) bias = w[2];
  if (x.size(0) == 1) return matvec(x, w[0], bias);
  return packed_linear(x, w[1], w[0].size(0), bias);
}

}  // namespace

// hidden [T, E]: the step's token embeddings, one token per sequence (it is
// used as the residual stream and changed in place). Returns the final
// norm's output [T, E]. The caches, block tables and slots are those of the
// attention layers; cos_cache / sin_cache are RotaryEmbedding's tables.
at::Tensor llama_decode_forward(at::Tensor hidden, at::Tensor positions,
                                at::Tensor slot_mapping, at::Tensor block_tables,
                                at::Tensor seq_lens, at::Tensor cos_cache, at::Tensor sin_cache,
                                at::TensorList k_caches, at::TensorList v_caches,
                                at::TensorList weights, at::Tensor final_norm,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers,
              "llama_decode_forward: need one K and one V cache per layer, got ",
              k_caches.size(), " and ", v_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kTensorsPerLayer,
              "llama_decode_forward: weights must hold ", kTensorsPerLayer,
              " tensors per layer (", layers * kTensorsPerLayer, "), got ", weights.size());
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat &&
                  hidden.size(0) == seq_lens.size(0),
              "llama_decode_forward: hidden must be float32 [sequences, hidden], one row "
              "per sequence, got ", hidden.scalar_type(), " ", hidden.sizes(), " for ",
              seq_lens.size(0), " sequences");
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor residual = hidden, h;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kTensorsPerLayer;
    // Pre-norm residual blocks; the residual add is fused into the next norm.
    at::Tensor x = i == 0 ? rms_norm(hidden, w[0], eps) : fused_add_rms_norm(h, residual, w[0], eps);
    at::Tensor qkv = linear(x, w + 1);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    rotary_embedding(positions, q, k, cos_cache, sin_cache);
    reshape_and_cache(k, v, k_caches[i], v_caches[i], slot_mapping);
    at::Tensor attn = paged_decode_attention(q, k_caches[i], v_caches[i], block_tables, seq_lens,
                                             scale);
    h = linear(attn.view({tokens, q_size}), w + 4);
    x = fused_add_rms_norm(h, residual, w[7], eps);
    h = linear(silu_and_mul(linear(x, w + 8)), w + 11);
  }
  return fused_add_rms_norm(h, residual, final_norm, eps);
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("llama_decode_forward(Tensor(a!) hidden, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor cos_cache, Tensor sin_cache, "
        "Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor[] weights, Tensor final_norm, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("llama_decode_forward", &minivllm::llama_decode_forward);
}
