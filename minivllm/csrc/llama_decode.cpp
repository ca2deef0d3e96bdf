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
// It covers pure decode steps (one new token per sequence) of float32 and
// bfloat16 models whose linear weights are packed (prepack.py); the Python
// side (minivllm/model/models/llama_fused_decode.py) checks that and falls
// back to the layers otherwise.
#include <ATen/core/dispatch/Dispatcher.h>

#include "cpu_types.h"
#include "ops.h"

namespace minivllm {
namespace {

// Per layer, the flat weight list holds, in this order:
//   input_layernorm, qkv (4 tensors), o_proj (4), post_attention_layernorm,
//   gate_up (4), down (4)
// and each linear layer's 4 are: the weight, its float32 panels for gemm.cpp,
// the bias, and the GEMM library's packed copy (prepack.PackedWeight.gemm).
// An absent bias or panels is an empty tensor. Keep in step with
// llama_fused_decode.py.
constexpr int64_t kTensorsPerLinear = 4;
constexpr int64_t kTensorsPerLayer = 2 + 4 * kTensorsPerLinear;

// The packed-weight products PyTorch registers (what torch.compile emits for
// frozen CPU linears), looked up once in the dispatcher.
at::Tensor mkl_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const c10::optional<at::Tensor>&, int64_t)>();
  return op.call(x, packed, weight, bias, x.size(0));
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            c10::string_view, c10::List<c10::optional<at::Scalar>>,
                            c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<at::Scalar>>(), "");
}

// One linear layer, choosing its product exactly as prepack.linear does:
// bfloat16 through oneDNN; float32 one row through matvec, up to
// panel_max_rows through the panel GEMM, more through MKL's packed GEMM.
at::Tensor linear(const at::Tensor& x, const at::Tensor* w, int64_t panel_max_rows) {
  const at::Tensor &weight = w[0], &panels = w[1], &packed = w[3];
  c10::optional<at::Tensor> bias;
  if (w[2].numel() > 0) bias = w[2];
  if (x.scalar_type() == at::kBFloat16) return onednn_linear(x, packed, bias);
  const int64_t rows = x.size(0);
  const bool has_panels = panels.numel() > 0;
  if (rows < 2) return has_panels ? matvec(x, weight, bias) : at::linear(x, weight, bias);
  if (has_panels && rows <= panel_max_rows)
    return packed_linear(x, panels, weight.size(0), bias);
  return mkl_linear(x, packed, weight, bias);
}

}  // namespace

// hidden [T, E]: the step's token embeddings, one token per sequence (it is
// used as the residual stream and changed in place). Returns the final
// norm's output [T, E]. The caches, block tables and slots are those of the
// attention layers; cos_cache / sin_cache are RotaryEmbedding's tables;
// panel_max_rows is prepack.PANEL_MAX_ROWS.
at::Tensor llama_decode_forward(at::Tensor hidden, at::Tensor positions,
                                at::Tensor slot_mapping, at::Tensor block_tables,
                                at::Tensor seq_lens, at::Tensor cos_cache, at::Tensor sin_cache,
                                at::TensorList k_caches, at::TensorList v_caches,
                                at::TensorList weights, at::Tensor final_norm,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                double eps, double scale, int64_t panel_max_rows) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers,
              "llama_decode_forward: need one K and one V cache per layer, got ",
              k_caches.size(), " and ", v_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kTensorsPerLayer,
              "llama_decode_forward: weights must hold ", kTensorsPerLayer,
              " tensors per layer (", layers * kTensorsPerLayer, "), got ", weights.size());
  TORCH_CHECK(hidden.dim() == 2 &&
                  (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16) &&
                  hidden.size(0) == seq_lens.size(0),
              "llama_decode_forward: hidden must be float32 or bfloat16 [sequences, hidden], one row "
              "per sequence, got ", hidden.scalar_type(), " ", hidden.sizes(), " for ",
              seq_lens.size(0), " sequences");
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor residual = hidden, h;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kTensorsPerLayer;
    // Pre-norm residual blocks; the residual add is fused into the next norm.
    at::Tensor x = i == 0 ? rms_norm(hidden, w[0], eps) : fused_add_rms_norm(h, residual, w[0], eps);
    at::Tensor qkv = linear(x, w + 1, panel_max_rows);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    rotary_embedding(positions, q, k, cos_cache, sin_cache);
    reshape_and_cache(k, v, k_caches[i], v_caches[i], slot_mapping);
    at::Tensor attn = paged_decode_attention(q, k_caches[i], v_caches[i], block_tables, seq_lens,
                                             scale);
    h = linear(attn.view({tokens, q_size}), w + 5, panel_max_rows);
    x = fused_add_rms_norm(h, residual, w[9], eps);
    h = linear(silu_and_mul(linear(x, w + 10, panel_max_rows)), w + 14, panel_max_rows);
  }
  return fused_add_rms_norm(h, residual, final_norm, eps);
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("llama_decode_forward(Tensor(a!) hidden, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor cos_cache, Tensor sin_cache, "
        "Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor[] weights, Tensor final_norm, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, "
        "int panel_max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("llama_decode_forward", &minivllm::llama_decode_forward);
}

// oneDNN's packed bfloat16 weights are MkldnnCPU tensors: a weight list that
// holds them dispatches here.
TORCH_LIBRARY_IMPL(minivllm, MkldnnCPU, m) {
  m.impl("llama_decode_forward", &minivllm::llama_decode_forward);
}
