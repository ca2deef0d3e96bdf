// A whole decode step of a Llama-family model in one call: the layer loop of
// minivllm/model/models/llama.py, written out in C++ over the same kernels.
//
// Why: in eager PyTorch every operator of a decode step also costs a Python
// module call and a trip through the dispatcher, about ten operators a layer,
// for every layer: for a small model at small batches that overhead is a large
// part of a step, in which the kernels themselves are short (chapter 15
// measures it with profile_ops; `minivllm bench throughput` with
// MINIVLLM_FUSED_DECODE=0 shows the end-to-end difference). Running the loop
// here removes that cost; the arithmetic is the same kernels in the
// same order, so the results are bit for bit those of the Python layers.
// (vLLM gets the same effect on GPUs by replaying a CUDA graph.)
//
// It covers pure decode steps (one new token per sequence) of float32 and
// bfloat16 models whose linear weights are packed (prepack.py); the Python
// side (minivllm/cpu/fused_decode.py) checks that and falls
// back to the layers otherwise. A float32 step of up to panel_max_rows
// sequences, whose products are all our own kernels, goes further: the whole
// step is one OpenMP parallel region (decode_in_one_region below).
//
// The family's variants take the same loop (fused_decode.py lists them): q/k
// norm (Qwen3), Gemma 3's sandwich norms and GeGLU, a hybrid model's
// per-layer KV cache groups (block table, slots, sliding window) and RoPE
// tables (LayerPlan below), and a mixture of experts' sparse layers, whose MLP
// is moe_decode.cpp's (a float32 step runs it between two parallel regions).
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cpu_types.h"
#include "decode_region.h"
#include "ops.h"

namespace minivllm {
namespace {

// Per layer, the flat weight list holds, in this order:
//   input_layernorm, qkv (4 tensors), o_proj (4), post_attention_layernorm,
//   gate_up (4), down (4)
// and each linear layer's 4 are: the weight, its float32 panels for gemm.cpp,
// the bias, and the GEMM library's packed copy (prepack.PackedWeight.gemm).
// An absent bias or panels is an empty tensor. A quantized layer's 4 are its
// GGUF blocks (uint8 [out, row_bytes]), no panels, the bias, and its GGML type
// id (int64 [1]; or [2]: type id, then 1 for int8 activations):
// gguf_gemm.cpp computes its product on the blocks (gguf_int8.cpp with int8
// activations). A mixture of experts' layer has empty gate_up and down (its
// MLP's tensors come in moe_weights: add_moe_layers). Keep in step with
// fused_decode.py.
constexpr int64_t kTensorsPerLinear = 4;
constexpr int64_t kTensorsPerLayer = 2 + 4 * kTensorsPerLinear;
// With LoRA, lora_weights holds per layer (lora_a, lora_b) of qkv, o, gate_up
// and down (fused_decode.py's _lora_tensors).
constexpr int64_t kLoRATensorsPerLayer = 8;
// The family's variants (fused_decode.py's _layer_norms): layer_norms holds per
// layer nothing (Llama), q_norm and k_norm (Qwen3: per-head RMSNorm of q and k
// before RoPE), or those and pre_feedforward_layernorm, post_feedforward_layernorm
// (Gemma 3's "sandwich": each sublayer's output normed before the residual add;
// its post_attention_layernorm is the attention output's). Gemma's (1 + w) norms
// come folded into float32 weights, so the one RMSNorm kernel serves them all.
constexpr int64_t kQKNorms = 2, kSandwichNorms = 4;

// Where layer i's attention reads and writes: its KV cache group's block table
// and slots, that group's sliding window (0: none), and its RoPE tables (a
// hybrid model's local and global layers rotate with different bases).
struct LayerPlan {
  at::Tensor table, slots, cos, sin;
  int64_t window = 0;
  const at::Tensor* norms = nullptr;  // its layer_norms (q, k[, pre_ff, post_ff]) or none
  int64_t norm_count = 0;             // 0, kQKNorms or kSandwichNorms
  // A mixture of experts' layer (moe_decode.cpp): its kTensorsPerMoE tensors and
  // kIntsPerMoE ints, and its expert load; its gate_up and down are empty.
  const at::Tensor* moe = nullptr;
  const int64_t* moe_config = nullptr;
  at::Tensor expert_load;
};

// One plan a layer from the step's arguments: with no groups, every layer takes
// block_tables and slot_mapping; with no ropes, cos_cache and sin_cache.
std::vector<LayerPlan> layer_plans(int64_t layers, const at::Tensor& block_tables,
                                   const at::Tensor& slot_mapping, const at::Tensor& cos_cache,
                                   const at::Tensor& sin_cache, at::TensorList layer_norms,
                                   at::TensorList group_tables, at::IntArrayRef group_windows,
                                   at::IntArrayRef layer_groups, at::TensorList ropes,
                                   at::IntArrayRef layer_ropes) {
  const int64_t groups = static_cast<int64_t>(group_windows.size());
  const int64_t rope_count = static_cast<int64_t>(ropes.size()) / 2;
  const int64_t norms = static_cast<int64_t>(layer_norms.size()) / layers;
  TORCH_CHECK(static_cast<int64_t>(layer_norms.size()) == norms * layers &&
                  (norms == 0 || norms == kQKNorms || norms == kSandwichNorms),
              "llama_decode_forward: layer_norms must hold 0, ", kQKNorms, " (q_norm, k_norm) or ",
              kSandwichNorms, " (and pre/post_feedforward_layernorm) tensors per layer (",
              layers, " layers), got ", layer_norms.size());
  TORCH_CHECK(static_cast<int64_t>(group_tables.size()) == 2 * groups &&
                  static_cast<int64_t>(layer_groups.size()) == (groups ? layers : 0),
              "llama_decode_forward: group_tables must hold (block table, slot mapping) per "
              "group of group_windows (", groups, "), and layer_groups one group per layer (",
              layers, ") when there are groups; got ", group_tables.size(), " and ",
              layer_groups.size());
  TORCH_CHECK(static_cast<int64_t>(ropes.size()) == 2 * rope_count &&
                  static_cast<int64_t>(layer_ropes.size()) == (rope_count ? layers : 0),
              "llama_decode_forward: ropes must hold (cos, sin) pairs and layer_ropes one "
              "index a layer (", layers, ") when given; got ", ropes.size(), " and ",
              layer_ropes.size());
  std::vector<LayerPlan> plans(layers);
  for (int64_t i = 0; i < layers; ++i) {
    LayerPlan& p = plans[i];
    p.table = block_tables, p.slots = slot_mapping, p.cos = cos_cache, p.sin = sin_cache;
    if (groups) {
      const int64_t g = layer_groups[i];
      TORCH_CHECK(g >= 0 && g < groups, "llama_decode_forward: layer_groups[", i, "] = ", g,
                  "; allowed: 0 to ", groups - 1);
      p.table = group_tables[2 * g].contiguous(), p.slots = group_tables[2 * g + 1].contiguous();
      p.window = group_windows[g];
      TORCH_CHECK(p.window >= 0, "llama_decode_forward: group_windows[", g, "] = ", p.window,
                  "; allowed: 0 (none) or a window of >= 1 positions");
    }
    if (rope_count) {
      const int64_t r = layer_ropes[i];
      TORCH_CHECK(r >= 0 && r < rope_count, "llama_decode_forward: layer_ropes[", i, "] = ", r,
                  "; allowed: 0 to ", rope_count - 1);
      p.cos = ropes[2 * r], p.sin = ropes[2 * r + 1];
    }
    if (norms) p.norms = layer_norms.data() + i * norms, p.norm_count = norms;
  }
  return plans;
}

// The MoE layers' parts of the plans: moe_weights holds kTensorsPerMoE tensors,
// moe_config kIntsPerMoE ints (the first its layer) and expert_loads one tensor
// per MoE layer, in layer order.
void add_moe_layers(std::vector<LayerPlan>& plans, at::TensorList moe_weights,
                    at::IntArrayRef moe_config, at::TensorList expert_loads,
                    int64_t hidden_size, at::ScalarType dtype) {
  const int64_t count = static_cast<int64_t>(expert_loads.size());
  TORCH_CHECK(static_cast<int64_t>(moe_weights.size()) == count * kTensorsPerMoE &&
                  static_cast<int64_t>(moe_config.size()) == count * kIntsPerMoE,
              "llama_decode_forward: moe_weights must hold ", kTensorsPerMoE, " tensors and "
              "moe_config ", kIntsPerMoE, " ints per mixture-of-experts layer (", count,
              " expert_loads); got ", moe_weights.size(), " and ", moe_config.size());
  for (int64_t m = 0; m < count; ++m) {
    const int64_t* config = moe_config.data() + m * kIntsPerMoE;
    const int64_t i = config[0];
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(plans.size()) && plans[i].moe == nullptr &&
                    plans[i].norm_count != kSandwichNorms,
                "llama_decode_forward: moe_config names layer ", i, ": not a layer, a layer "
                "named twice, or a layer with sandwich norms");
    LayerPlan& p = plans[i];
    p.moe = moe_weights.data() + m * kTensorsPerMoE, p.moe_config = config;
    p.expert_load = expert_loads[m];
    check_moe_layer(p.moe, config, p.expert_load, hidden_size, dtype);
  }
}

}  // namespace

// (Outside the anonymous namespace: mla_decode_step.cpp's loop calls linear too.)
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
// `halves`: the panels are laid out in halves (pack_linear_weight).
at::Tensor linear(const at::Tensor& x, const at::Tensor* w, int64_t panel_max_rows,
                  bool halves) {
  const at::Tensor &weight = w[0], &panels = w[1], &packed = w[3];
  c10::optional<at::Tensor> bias;
  if (w[2].numel() > 0) bias = w[2];
  if (weight.scalar_type() == at::kByte) {
    const int64_t qtype = packed[0].item<int64_t>();
    return packed.numel() > 1 && packed[1].item<int64_t>() ? gguf_linear_int8(x, weight, qtype, bias)
                                                           : gguf_linear(x, weight, qtype, bias);
  }
  if (x.scalar_type() == at::kBFloat16) return onednn_linear(x, packed, bias);
  const int64_t rows = x.size(0);
  const bool has_panels = panels.numel() > 0;
  if (rows < 2) return has_panels ? matvec(x, weight, bias) : at::linear(x, weight, bias);
  if (has_panels && rows <= panel_max_rows)
    return packed_linear(x, panels, weight.size(0), bias, halves);
  return mkl_linear(x, packed, weight, bias);
}

namespace {


// float32 steps whose products are all our own kernels run in one OpenMP
// parallel region (decode_region.h: why, and its barrier, work sharing and
// linear layers).

// Is every linear layer's product at `tokens` rows one of our own kernels
// (float32 panels, or GGUF blocks), so the step needs no MKL?
bool own_product(const at::Tensor* w, int64_t tokens) {
  if (w[0].scalar_type() == at::kByte) return tokens <= slice::gguf_max_rows;
  return w[1].numel() > 0;
}

// (A mixture of experts' layer has no gate_up and down: its MLP runs between
// regions, moe_decode.cpp.)
bool all_panels(at::TensorList weights, int64_t tokens) {
  for (size_t i = 0; i < weights.size(); i += kTensorsPerLayer)
    for (size_t j : {1, 5, 10, 14})
      if (weights[i + j].numel() > 0 && !own_product(weights.data() + i + j, tokens))
        return false;
  return true;
}

// The rows of the dense MLPs' intermediate (gate_up_proj's [gate; up] / 2);
// 0 if every layer's MLP is a mixture of experts.
int64_t dense_intermediate(at::TensorList weights) {
  for (size_t i = 0; i < weights.size(); i += kTensorsPerLayer)
    if (weights[i + 10].numel() > 0) return weights[i + 10].size(0) / 2;
  return 0;
}

float* f32(const at::Tensor& t) { return t.data_ptr<float>(); }

void check_f32(const at::Tensor& t, at::IntArrayRef sizes, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == sizes,
              "llama_decode_forward: ", name, " must be contiguous float32 ", sizes, ", got ",
              t.scalar_type(), " ", t.sizes());
}

// The positions, slots and block tables are followed without bounds checks
// in the region: check them here.
void check_step(const at::Tensor& positions, const at::Tensor& slot_mapping,
                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                const at::Tensor& cos_cache, const at::Tensor& k_cache, int64_t tokens,
                int64_t window) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.sizes() == at::IntArrayRef({tokens}) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.sizes() == at::IntArrayRef({tokens}),
              "llama_decode_forward: positions and slot_mapping must be contiguous int64 [",
              tokens, "]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t slot_count = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_cache.size(0), "llama_decode_forward: position ",
                pos[t], " is outside the RoPE tables' [0, ", cos_cache.size(0), ")");
    TORCH_CHECK(slots[t] < slot_count, "llama_decode_forward: slot ", slots[t],
                " is outside the cache's ", slot_count, " slots");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "llama_decode_forward: block_tables and seq_lens must be contiguous int32");
  check_block_tables(block_tables, seq_lens, tokens, k_cache.size(0), k_cache.size(1), window);
}

// check_step for each layer's tables (once per distinct table and RoPE pair),
// and their RoPE tables' shapes.
void check_plans(const std::vector<LayerPlan>& plans, const at::Tensor& positions,
                 const at::Tensor& seq_lens, const at::Tensor& k_cache, int64_t tokens,
                 int64_t dim) {
  for (size_t i = 0; i < plans.size(); ++i) {
    const LayerPlan& p = plans[i];
    if (i > 0 && p.table.is_same(plans[i - 1].table) && p.cos.is_same(plans[i - 1].cos)) continue;
    check_f32(p.sin, p.cos.sizes(), "sin_cache");
    check_f32(p.cos, {p.cos.size(0), dim}, "cos_cache");
    check_step(positions, p.slots, p.table, seq_lens, p.cos, k_cache, tokens, p.window);
  }
}

at::Tensor decode_in_one_region(at::Tensor hidden, at::Tensor positions, at::Tensor seq_lens,
                                const std::vector<LayerPlan>& plans, at::TensorList k_caches,
                                at::TensorList v_caches, at::TensorList weights,
                                const at::Tensor& final_norm, at::TensorList lm_head,
                                int64_t heads, int64_t kv_heads, int64_t dim, float eps,
                                float scale, bool gate_up_halves, bool gelu,
                                at::TensorList lora_weights, const LoRAGroups* lora_groups,
                                int64_t panel_max_rows) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  const int64_t T = hidden.size(0), E = hidden.size(1);
  const int64_t q_size = heads * dim, kv_size = kv_heads * dim, qkv_size = q_size + 2 * kv_size;
  const int64_t inter = dense_intermediate(weights);
  check_f32(hidden, {T, E}, "hidden");
  check_f32(final_norm, {E}, "final_norm");
  TORCH_CHECK(dim % 2 == 0 && heads % kv_heads == 0, "llama_decode_forward: head_dim ", dim,
              " must be even and heads ", heads, " a multiple of kv_heads ", kv_heads);
  const at::Tensor& kc0 = k_caches[0];
  std::vector<float*> kc, vc;
  const at::IntArrayRef cache_shape = kc0.sizes();
  for (int64_t i = 0; i < layers; ++i) {
    check_f32(k_caches[i], {cache_shape[0], cache_shape[1], kv_heads, dim}, "k cache");
    check_f32(v_caches[i], {cache_shape[0], cache_shape[1], kv_heads, dim}, "v cache");
    kc.push_back(f32(k_caches[i]));
    vc.push_back(f32(v_caches[i]));
  }
  positions = positions.contiguous();
  seq_lens = seq_lens.contiguous();
  check_plans(plans, positions, seq_lens, kc0, T, dim);
  std::vector<Linear> qkv, o;
  std::vector<std::optional<Linear>> gate_up, down;  // none: a mixture of experts
  std::vector<const float*> in_norm, post_norm;
  // Per layer: its attention's pointers (LayerPlan), and the variants' norms.
  struct Attend {
    const int32_t* tables;
    const int64_t* slots;
    const float *cos, *sin;
    int64_t width, window;
    const float *q_norm = nullptr, *k_norm = nullptr, *pre_ff = nullptr, *post_ff = nullptr;
  };
  std::vector<Attend> at_layer;
  for (const LayerPlan& p : plans) {
    Attend a{p.table.data_ptr<int32_t>(), p.slots.data_ptr<int64_t>(), f32(p.cos), f32(p.sin),
             p.table.size(1), p.window};
    if (p.norms != nullptr) {
      check_f32(p.norms[0], {dim}, "q_norm weight");
      check_f32(p.norms[1], {dim}, "k_norm weight");
      a.q_norm = f32(p.norms[0]), a.k_norm = f32(p.norms[1]);
    }
    if (p.norm_count == kSandwichNorms) {
      check_f32(p.norms[2], {E}, "pre_feedforward_layernorm weight");
      check_f32(p.norms[3], {E}, "post_feedforward_layernorm weight");
      a.pre_ff = f32(p.norms[2]), a.post_ff = f32(p.norms[3]);
    }
    at_layer.push_back(a);
  }

  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kTensorsPerLayer;
    check_f32(w[0], {E}, "input_layernorm weight");
    check_f32(w[9], {E}, "post_attention_layernorm weight");
    in_norm.push_back(f32(w[0]));
    post_norm.push_back(f32(w[9]));
    const std::string layer = "layer " + std::to_string(i) + " ";
    qkv.emplace_back(w + 1, E, qkv_size, layer + "qkv_proj");
    o.emplace_back(w + 5, q_size, E, layer + "o_proj");
    gate_up.emplace_back(), down.emplace_back();
    if (plans[i].moe != nullptr) continue;
    gate_up.back().emplace(w + 10, E, 2 * inter, layer + "gate_up_proj");
    gate_up.back()->halves = gate_up_halves;
    down.back().emplace(w + 14, inter, E, layer + "down_proj");
  }
  // LoRA: each product's delta right after it (A then B, lora.cpp's kernels).
  std::vector<LoRALinear> lora;
  int64_t max_rank = 0;
  for (int64_t i = 0; i < layers && !lora_weights.empty(); ++i) {
    const at::Tensor* f = lora_weights.data() + i * kLoRATensorsPerLayer;
    const std::string layer = "layer " + std::to_string(i) + " ";
    // (q, k, v and gate, up: the modules cpu/lora.py's twin gives the kernel too)
    lora.emplace_back(f[0], f[1], E, qkv_size, std::vector<int64_t>{q_size, kv_size, kv_size},
                      layer + "qkv_proj");
    lora.emplace_back(f[2], f[3], q_size, E, std::vector<int64_t>{}, layer + "o_proj");
    lora.emplace_back(f[4], f[5], E, 2 * inter, std::vector<int64_t>{inter, inter},
                      layer + "gate_up_proj");
    lora.emplace_back(f[6], f[7], inter, E, std::vector<int64_t>{}, layer + "down_proj");
    for (int64_t k = 4 * i; k < 4 * i + 4; ++k) max_rank = std::max(max_rank, lora[k].r);
  }
  // The LM head, when given, is the step's last product: logits without
  // leaving the region (for one row, the Python and thread wake-up around a
  // separate call are a visible share of a step).
  std::optional<Linear> head;
  if (!lm_head.empty()) head.emplace(lm_head.data(), E, lm_head[0].size(0), "lm_head");
  auto options = hidden.options();
  at::Tensor x = at::empty({T, E}, options), h = at::empty({T, E}, options);
  at::Tensor qkv_out = at::empty({T, qkv_size}, options), attn = at::empty({T, q_size}, options);
  at::Tensor gu = at::empty({T, 2 * inter}, options), act = at::empty({T, inter}, options);
  at::Tensor out = at::empty({T, E}, options);
  at::Tensor lora_y = at::empty({T, max_rank}, options);  // one product's shrink at a time
  float *res = f32(hidden), *xp = f32(x), *hp = f32(h), *qkvp = f32(qkv_out);
  float *attnp = f32(attn), *gup = f32(gu), *actp = f32(act), *lora_yp = f32(lora_y);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float* final_w = f32(final_norm);
  at::Tensor logits = head ? at::empty({T, head->out}, options) : at::Tensor();
  float *outp = f32(out), *logitsp = head ? f32(logits) : nullptr;
  const int64_t block_size = cache_shape[1];
  SpinBarrier barrier;
  // 5 jobs a layer: 4 products and the attention; then the LM head. (Should
  // OpenMP start fewer threads than asked for, the shares of the missing ones
  // are taken as leftovers.)
  // With LoRA, then 2 jobs per product: the shrink and the expand.
  SharedWork work(5 * layers + 1 + 2 * static_cast<int64_t>(lora.size()), at::get_num_threads());
  // More than one row takes the panel kernel, whose epilogue can do SiLU-and-mul
  // when gate_up's panels are in halves (one row takes matvec: a pass after it);
  // not with LoRA, whose delta joins [gate | up] before the SiLU.
  // (GeGLU's gate is a pass of its own.)
  const bool fuse_silu = gate_up_halves && T > 1 && lora.empty() && !gelu;
  // A mixture of experts' layer ends the region after its post-attention norm:
  // its MLP runs between two regions (moe_decode.cpp: the router's top-k and the
  // experts' own work sharing), and the next region starts at the next layer.
  for (int64_t first = 0;;) {
    int64_t stop = first;  // the next MoE layer, or `layers`: the region runs to the end
    while (stop < layers && plans[stop].moe == nullptr) ++stop;
#pragma omp parallel num_threads(work.threads())
    {
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      if (t == 0) barrier.set_threads(n);
#pragma omp barrier
      const Share rows(T, t, n), cols(inter, t, n);
      const int64_t items = T * kv_heads, item_chunk = std::max<int64_t>(1, items / (8 * n));
      // The LoRA delta of product k (0 qkv, 1 o, 2 gate_up, 3 down) of layer i, for
      // the step's LoRA tokens (nothing without LoRA): the shrink of its input x
      // runs with the product (it needs only x), the expand into the product's
      // output y [T, ldo] after it, then a barrier.
      auto lora_shrink = [&](int64_t i, int64_t k, const float* x) {
        if (lora.empty()) return;
        const LoRALinear& f = lora[4 * i + k];
        work.run(5 * layers + 1 + 2 * (4 * i + k), slice::bgmv_shrink_items(*lora_groups, f.r), 1,
                 t, [&](int64_t b, int64_t e) {
                   slice::bgmv_shrink(x, f.in, f.a, f.r, f.in, *lora_groups, lora_yp, f.r, b, e);
                 });
      };
      auto lora_expand = [&](int64_t i, int64_t k, float* y, int64_t ldo) {
        if (lora.empty()) return;
        const LoRALinear& f = lora[4 * i + k];
        const int64_t panels = slice::bgmv_expand_items(*lora_groups, f.out);
        work.run(5 * layers + 2 + 2 * (4 * i + k), panels, std::max<int64_t>(1, panels / (8 * n)),
                 t, [&](int64_t b, int64_t e) {
                   slice::bgmv_expand(lora_yp, f.r, f.bt, f.r, f.out, f.slice_ends.data(),
                                      static_cast<int64_t>(f.slice_ends.size()), *lora_groups, y,
                                      ldo, b, e);
                 });
        barrier.wait();
      };
      for (int64_t i = first; i < layers; ++i) {
        // Pre-norm residual blocks; the residual add is fused into the next norm.
        if (i == 0) slice::rms_norm(res, E, nullptr, in_norm[i], xp, E, eps, rows.begin, rows.end);
        else slice::rms_norm(hp, E, res, in_norm[i], xp, E, eps, rows.begin, rows.end);
        barrier.wait();
        qkv[i].run(xp, T, qkvp, work, 5 * i + 0, t);
        lora_shrink(i, 0, xp);
        barrier.wait();
        lora_expand(i, 0, qkvp, qkv_size);
        const Attend& a = at_layer[i];
        float *q = qkvp, *k = qkvp + q_size, *v = k + kv_size;
        for (int64_t r = rows.begin; a.q_norm != nullptr && r < rows.end; ++r) {
          // Each head's RMSNorm, in place (the twin's rows of q.reshape(-1, dim)).
          float *qr = q + r * qkv_size, *kr = k + r * qkv_size;
          slice::rms_norm(qr, dim, nullptr, a.q_norm, qr, dim, eps, 0, heads);
          slice::rms_norm(kr, dim, nullptr, a.k_norm, kr, dim, eps, 0, kv_heads);
        }
        slice::rotary_embedding(pos, q, qkv_size, heads, k, qkv_size, kv_heads, a.cos, a.sin, dim,
                                rows.begin, rows.end);
        slice::reshape_and_cache(k, qkv_size, v, qkv_size, kc[i], vc[i], a.slots, kv_heads, dim,
                                 rows.begin, rows.end);
        barrier.wait();
        // (sequence, KV head) items, a few at a time (contexts differ in length);
        // within a chunk each item prefetches the next one's first block.
        work.run(5 * i + 4, items, item_chunk, t, [&](int64_t b, int64_t e) {
          slice::paged_decode_attention(q, qkv_size, kc[i], vc[i], a.tables, lens, attnp, heads,
                                        kv_heads, dim, block_size, a.width, scale, a.window, b, e);
        });
        barrier.wait();
        o[i].run(attnp, T, hp, work, 5 * i + 1, t);
        lora_shrink(i, 1, attnp);
        barrier.wait();
        lora_expand(i, 1, hp, E);
        if (a.pre_ff != nullptr) {
          // Sandwich: the attention output normed (in place), added to the
          // residual, and the sum normed for the MLP.
          slice::rms_norm(hp, E, nullptr, post_norm[i], hp, E, eps, rows.begin, rows.end);
          slice::rms_norm(hp, E, res, a.pre_ff, xp, E, eps, rows.begin, rows.end);
        } else {
          slice::rms_norm(hp, E, res, post_norm[i], xp, E, eps, rows.begin, rows.end);
        }
        if (i == stop) break;  // its MLP is a mixture of experts: after the region
        barrier.wait();
        if (fuse_silu) {
          // The panels hold gate and up columns side by side: the product's
          // epilogue applies SiLU-and-mul, so no pass over [gate | up] follows.
          gate_up[i]->run(xp, T, actp, work, 5 * i + 2, t, /*silu=*/true);
          barrier.wait();
        } else {
          gate_up[i]->run(xp, T, gup, work, 5 * i + 2, t);
          lora_shrink(i, 2, xp);
          barrier.wait();
          lora_expand(i, 2, gup, 2 * inter);
          // Element-wise: split by columns, so a single row uses every thread.
          if (gelu) slice::gelu_tanh_and_mul(gup, actp, T, inter, cols.begin, cols.end);
          else slice::silu_and_mul(gup, actp, T, inter, cols.begin, cols.end);
          barrier.wait();
        }
        down[i]->run(actp, T, hp, work, 5 * i + 3, t);
        lora_shrink(i, 3, actp);
        barrier.wait();
        lora_expand(i, 3, hp, E);
        // Sandwich: the MLP's output normed in place; the next norm adds it.
        if (a.post_ff != nullptr)
          slice::rms_norm(hp, E, nullptr, a.post_ff, hp, E, eps, rows.begin, rows.end);
      }
      if (stop == layers) {
        slice::rms_norm(hp, E, res, final_w, outp, E, eps, rows.begin, rows.end);
        if (head) {
          barrier.wait();
          head->run(outp, T, logitsp, work, 5 * layers, t);
        }
      }
    }
    if (stop == layers) break;
    // The MoE layer's MLP on the post-attention norm's output x; its output
    // goes where a dense MLP's would, for the next layer's norm to add.
    const LayerPlan& p = plans[stop];
    h.copy_(sparse_moe_block(x, p.moe, p.moe_config, p.expert_load, panel_max_rows));
    first = stop + 1;
  }
  return head ? logits : out;
}

}  // namespace

// hidden [T, E]: the step's token embeddings, one token per sequence (it is
// used as the residual stream and changed in place). Returns the final
// norm's output [T, E], or with lm_head (its 4 tensors, as a linear layer's
// above) the logits [T, vocab rows]. The caches, block tables and slots are
// those of the attention layers; cos_cache / sin_cache are RotaryEmbedding's
// tables; panel_max_rows is prepack.PANEL_MAX_ROWS, lm_head_panel_max_rows
// the LM head's PackedWeight.panel_max_rows; gate_up_halves says every
// gate_up weight's panels are in halves (PackedWeight.halves). With
// lora_weights (kLoRATensorsPerLayer per layer) and token_lora_indices (each
// token's slot, -1 for the base model), each linear's LoRA delta is added to
// its output, as the layers' hook adds it.
// The variants: layer_norms (see kQKNorms, kSandwichNorms), gelu (GeGLU for
// SwiGLU); a hybrid model's KV cache groups: group_tables (block table int32,
// slot mapping int64 per group), group_windows (0: none) and layer_groups
// (each layer's group; none: block_tables and slot_mapping for all); its RoPE
// tables: ropes ((cos, sin) pairs) and layer_ropes (none: cos/sin_cache for all).
// A mixture of experts' layers (their gate_up and down empty in weights):
// moe_weights, moe_config and expert_loads, as add_moe_layers reads them.
at::Tensor llama_decode_forward(at::Tensor hidden, at::Tensor positions,
                                at::Tensor slot_mapping, at::Tensor block_tables,
                                at::Tensor seq_lens, at::Tensor cos_cache, at::Tensor sin_cache,
                                at::TensorList k_caches, at::TensorList v_caches,
                                at::TensorList weights, at::Tensor final_norm,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                double eps, double scale, int64_t panel_max_rows,
                                at::TensorList lm_head, int64_t lm_head_panel_max_rows,
                                bool gate_up_halves, at::TensorList lora_weights,
                                c10::optional<at::Tensor> token_lora_indices,
                                at::TensorList layer_norms, bool gelu,
                                at::TensorList group_tables, at::IntArrayRef group_windows,
                                at::IntArrayRef layer_groups, at::TensorList ropes,
                                at::IntArrayRef layer_ropes, at::TensorList moe_weights,
                                at::IntArrayRef moe_config, at::TensorList expert_loads) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers,
              "llama_decode_forward: need one K and one V cache per layer, got ",
              k_caches.size(), " and ", v_caches.size());
  TORCH_CHECK(lm_head.empty() || static_cast<int64_t>(lm_head.size()) == kTensorsPerLinear,
              "llama_decode_forward: lm_head must be empty or hold ", kTensorsPerLinear,
              " tensors (weight, panels, bias, packed), got ", lm_head.size());
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
  std::vector<LayerPlan> plans =
      layer_plans(layers, block_tables.contiguous(), slot_mapping.contiguous(), cos_cache,
                  sin_cache, layer_norms, group_tables, group_windows, layer_groups, ropes,
                  layer_ropes);
  add_moe_layers(plans, moe_weights, moe_config, expert_loads, hidden.size(1),
                 hidden.scalar_type());
  std::optional<LoRAGroups> lora;
  if (!lora_weights.empty()) {
    TORCH_CHECK(expert_loads.empty(), "llama_decode_forward: LoRA on a mixture of experts' "
                "layers is not in the C++ loop");
    TORCH_CHECK(static_cast<int64_t>(lora_weights.size()) == layers * kLoRATensorsPerLayer &&
                    token_lora_indices.has_value() && token_lora_indices->dim() == 1 &&
                    token_lora_indices->size(0) == tokens,
                "llama_decode_forward: with LoRA, lora_weights must hold ",
                kLoRATensorsPerLayer, " tensors per layer (", layers * kLoRATensorsPerLayer,
                "), got ", lora_weights.size(), ", and token_lora_indices one slot per token (",
                tokens, ")");
    lora.emplace(*token_lora_indices, lora_weights[0].size(0), "llama_decode_forward");
  }
  // The LoRA delta of product k of layer i (the tensor-level kernels, as the
  // layers' hook calls them), added to its output in place.
  auto with_lora = [&](at::Tensor out, const at::Tensor& x, int64_t i, int64_t k,
                       at::IntArrayRef out_slices = {}) {
    if (lora) {
      const at::Tensor* f = lora_weights.data() + i * kLoRATensorsPerLayer + 2 * k;
      bgmv_expand_(out, bgmv_shrink(x, f[0], *token_lora_indices), f[1], *token_lora_indices,
                   out_slices);
    }
    return out;
  };
  if (hidden.scalar_type() == at::kFloat && packed_linear_available() && all_panels(weights, tokens) &&
      tokens <= panel_max_rows) {
    // The LM head joins the region when its product is also the panel kernel's
    // (or matvec's) at this many rows; otherwise it runs after it.
    const bool head_inside =
        !lm_head.empty() && (lm_head[0].scalar_type() == at::kByte
                                 ? own_product(lm_head.data(), tokens)
                                 : lm_head[1].numel() > 0 && tokens <= lm_head_panel_max_rows);
    at::Tensor out = decode_in_one_region(
        hidden, positions, seq_lens, plans, k_caches, v_caches, weights, final_norm,
        head_inside ? lm_head : at::TensorList(), num_heads, num_kv_heads, head_dim,
        static_cast<float>(eps), static_cast<float>(scale), gate_up_halves, gelu,
        lora ? lora_weights : at::TensorList(), lora ? &*lora : nullptr, panel_max_rows);
    if (head_inside || lm_head.empty()) return out;
    return linear(out, lm_head.data(), lm_head_panel_max_rows);
  }
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor residual = hidden, h;
  // A head's RMSNorm over rows of q or k [tokens, heads, dim] (a fresh tensor,
  // as the twin's q.reshape(-1, dim) is).
  auto head_norm = [&](const at::Tensor& t, const at::Tensor& w) {
    return rms_norm(t.reshape({-1, head_dim}), w, eps).view(t.sizes());
  };
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kTensorsPerLayer;
    const LayerPlan& p = plans[i];
    // Pre-norm residual blocks; the residual add is fused into the next norm.
    at::Tensor x = i == 0 ? rms_norm(hidden, w[0], eps) : fused_add_rms_norm(h, residual, w[0], eps);
    at::Tensor qkv =
        with_lora(linear(x, w + 1, panel_max_rows), x, i, 0, {q_size, kv_size, kv_size});
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    if (p.norms != nullptr) q = head_norm(q, p.norms[0]), k = head_norm(k, p.norms[1]);
    rotary_embedding(positions, q, k, p.cos, p.sin);
    reshape_and_cache(k, v, k_caches[i], v_caches[i], p.slots);
    at::Tensor attn = paged_decode_attention(q, k_caches[i], v_caches[i], p.table, seq_lens,
                                             scale, p.window);
    at::Tensor a = attn.view({tokens, q_size});
    h = with_lora(linear(a, w + 5, panel_max_rows), a, i, 1);
    const bool sandwich = p.norm_count == kSandwichNorms;
    x = sandwich ? fused_add_rms_norm(rms_norm(h, w[9], eps), residual, p.norms[2], eps)
                 : fused_add_rms_norm(h, residual, w[9], eps);
    if (p.moe != nullptr) {  // a mixture of experts (moe_decode.cpp)
      h = sparse_moe_block(x, p.moe, p.moe_config, p.expert_load, panel_max_rows);
      continue;
    }
    const int64_t inter = w[10].size(0) / 2;  // (w[14] may be quantized blocks)
    at::Tensor gate_up =
        with_lora(linear(x, w + 10, panel_max_rows, gate_up_halves), x, i, 2, {inter, inter});
    at::Tensor act = gelu ? gelu_tanh_and_mul(gate_up) : silu_and_mul(gate_up);
    h = with_lora(linear(act, w + 14, panel_max_rows), act, i, 3);
    if (sandwich) h = rms_norm(h, p.norms[3], eps);
  }
  at::Tensor out = fused_add_rms_norm(h, residual, final_norm, eps);
  return lm_head.empty() ? out : linear(out, lm_head.data(), lm_head_panel_max_rows);
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("llama_decode_forward(Tensor(a!) hidden, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor cos_cache, Tensor sin_cache, "
        "Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor[] weights, Tensor final_norm, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, "
        "int panel_max_rows, Tensor[] lm_head, int lm_head_panel_max_rows, "
        "bool gate_up_halves, Tensor[] lora_weights, Tensor? token_lora_indices, "
        "Tensor[] layer_norms, bool gelu, Tensor[] group_tables, int[] group_windows, "
        "int[] layer_groups, Tensor[] ropes, int[] layer_ropes, Tensor[] moe_weights, "
        "int[] moe_config, Tensor(d!)[] expert_loads) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("llama_decode_forward", &minivllm::llama_decode_forward);
}

// oneDNN's packed bfloat16 weights are MkldnnCPU tensors: a weight list that
// holds them dispatches here.
TORCH_LIBRARY_IMPL(minivllm, MkldnnCPU, m) {
  m.impl("llama_decode_forward", &minivllm::llama_decode_forward);
}
