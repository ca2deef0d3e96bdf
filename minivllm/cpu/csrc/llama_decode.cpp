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
// activations). Keep in step with fused_decode.py.
constexpr int64_t kTensorsPerLinear = 4;
constexpr int64_t kTensorsPerLayer = 2 + 4 * kTensorsPerLinear;
// With LoRA, lora_weights holds per layer (lora_a, lora_b) of qkv, o, gate_up
// and down (fused_decode.py's _lora_tensors).
constexpr int64_t kLoRATensorsPerLayer = 8;

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


// ---------------------------------------------------------------------------
// float32 steps whose products are all our own kernels (matvec, panel GEMM):
// the whole step in one OpenMP parallel region.
//
// Why: a decode step runs ~10 parallel kernels a layer, 300 a step. Each
// kernel its own parallel region means each ends with the threads going idle
// and the next starts by waking them. Under OMP_WAIT_POLICY=passive (what a
// machine shared with other processes wants) idle OpenMP threads sleep, and
// waking them hundreds of times a step adds up (chapter 15 shows the
// difference). In one region the threads split every kernel's
// work between them and meet at a barrier of our own that spins; they sleep
// only between steps.
// ---------------------------------------------------------------------------

// A barrier that spins (with the CPU's pause hint), and after a while also
// yields the core, in case it is shared with another busy process.
class SpinBarrier {
 public:
  void set_threads(int threads) { threads_ = threads; }

  void wait() {
    const int gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < kSpinsBeforeYield) _mm_pause();
      else std::this_thread::yield();
    }
  }

 private:
  // Spin this long before yielding the core: long enough to cover the gap
  // between two kernels of a step, short enough not to starve other processes.
  static constexpr int kSpinsBeforeYield = 1 << 14;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> generation_{0};
  int threads_ = 1;
};

// Thread t of n's share [begin, end) of `items` work items.
struct Share {
  int64_t begin, end;
  Share(int64_t items, int t, int n) : begin(items * t / n), end(items * (t + 1) / n) {}
};

// How the threads split each parallel piece of the step ("job": a product,
// an attention) into work items. Thread t starts on its own contiguous share
// and takes it front to back in chunks; when it is done, it takes chunks of
// what is left of the other threads' shares. Contiguous shares matter for
// the products: each thread's weight reads form one long stream that the
// prefetchers follow across chunks (a counter shared by all threads hands
// out chunks in alternation, and each chunk starts a new stream, which a
// single stream measurably pays for). Taking the others' leftovers keeps
// the threads level when one of them is slowed down: the main thread also
// serves Python, and another process may hold a core.
class SharedWork {
 public:
  SharedWork(int64_t jobs, int threads) : cursors_(jobs * threads), threads_(threads) {}

  int threads() const { return threads_; }

  // Calls fn(begin, end) on chunks of [0, items) until the job is done.
  template <typename Fn>
  void run(int64_t job, int64_t items, int64_t chunk, int t, Fn&& fn) {
    Cursor* cursors = cursors_.data() + job * threads_;
    for (int k = 0; k < threads_; ++k) {
      const int owner = (t + k) % threads_;
      const Share share(items, owner, threads_);
      std::atomic<int64_t>& taken = cursors[owner].taken;
      for (int64_t b; (b = share.begin + taken.fetch_add(chunk, std::memory_order_relaxed)) <
                      share.end;)
        fn(b, std::min(b + chunk, share.end));
    }
  }

 private:
  struct alignas(64) Cursor {  // a cache line each: shared only once others steal
    std::atomic<int64_t> taken{0};
  };
  std::vector<Cursor> cursors_;
  int threads_;
};

// One float32 linear layer as its raw pointers (weights list: weight,
// panels, bias, -), or a quantized one (blocks, -, bias, type id).
struct Linear {
  const float *weight = nullptr, *panels = nullptr, *bias = nullptr;
  const uint8_t* blocks = nullptr;  // a quantized layer's GGUF blocks
  int64_t qtype = -1, row_bytes = 0;
  bool int8 = false;  // x quantized to int8 blocks (gguf_int8.cpp)
  int64_t in, out;
  bool halves = false;  // panels in halves (gate_up_proj: the SiLU epilogue can run)

  // `what` names the layer in error messages ("layer 3 qkv_proj", "lm_head").
  Linear(const at::Tensor* w, int64_t in_features, int64_t out_features, const std::string& what)
      : in(in_features), out(out_features) {
    if (w[0].scalar_type() == at::kByte) {
      quantized(w, what);
      return;
    }
    const int64_t panel_count = (out + slice::panel_width - 1) / slice::panel_width;
    TORCH_CHECK(w[0].scalar_type() == at::kFloat && w[0].is_contiguous() &&
                    w[0].sizes() == at::IntArrayRef({out, in}),
                "llama_decode_forward: ", what, " weight must be contiguous float32 [", out,
                ", ", in, "], got ", w[0].scalar_type(), " ", w[0].sizes());
    TORCH_CHECK(w[1].scalar_type() == at::kFloat && w[1].is_contiguous() &&
                    w[1].sizes() == at::IntArrayRef({panel_count, in, slice::panel_width}),
                "llama_decode_forward: ", what, " panels must be pack_linear_weight's float32 [",
                panel_count, ", ", in, ", ", slice::panel_width, "], got ", w[1].scalar_type(),
                " ", w[1].sizes());
    TORCH_CHECK(w[2].numel() == 0 || (w[2].scalar_type() == at::kFloat && w[2].is_contiguous() &&
                                      w[2].sizes() == at::IntArrayRef({out})),
                "llama_decode_forward: ", what, " bias must be empty or float32 [", out,
                "], got ", w[2].sizes());
    weight = w[0].data_ptr<float>();
    panels = w[1].data_ptr<float>();
    bias = w[2].numel() > 0 ? w[2].data_ptr<float>() : nullptr;
  }

  void quantized(const at::Tensor* w, const std::string& what) {
    TORCH_CHECK(w[3].scalar_type() == at::kLong && (w[3].numel() == 1 || w[3].numel() == 2),
                "llama_decode_forward: ", what, " is quantized: its 4th tensor must be its GGML "
                "type id (int64 [1]) or that and the int8 flag ([2]), got ", w[3].scalar_type(),
                " ", w[3].sizes());
    qtype = w[3][0].item<int64_t>();
    int8 = w[3].numel() == 2 && w[3][1].item<int64_t>() != 0;
    TORCH_CHECK(!int8 || slice::gguf_int8_type(qtype), "llama_decode_forward: ", what,
                " asks for int8 activations but its GGML type ", qtype, " has no int8 product");
    row_bytes = gguf_row_bytes(qtype, in);
    TORCH_CHECK(row_bytes > 0, "llama_decode_forward: ", what, " has GGML type ", qtype,
                " with ", in, " columns, which the quantized kernels do not take");
    TORCH_CHECK(w[0].is_contiguous() && w[0].sizes() == at::IntArrayRef({out, row_bytes}),
                "llama_decode_forward: ", what, " blocks must be contiguous uint8 [", out, ", ",
                row_bytes, "], got ", w[0].sizes());
    TORCH_CHECK(w[2].numel() == 0 || (w[2].scalar_type() == at::kFloat && w[2].is_contiguous() &&
                                      w[2].sizes() == at::IntArrayRef({out})),
                "llama_decode_forward: ", what, " bias must be empty or float32 [", out,
                "], got ", w[2].sizes());
    blocks = w[0].data_ptr<uint8_t>();
    bias = w[2].numel() > 0 ? w[2].data_ptr<float>() : nullptr;
  }

  // This thread's part of y [rows, out] = x [rows, in] W^T + b: output
  // columns (groups of 4 for one row, panels of slice::panel_width for more),
  // split by `work`.
  // With silu (halves, more than one row): y [rows, out / 2] = silu(gate) * up.
  void run(const float* x, int64_t rows, float* y, SharedWork& work, int64_t job, int t,
           bool silu = false) const {
    if (int8) {  // each thread quantizes x itself (no barrier), then units of gguf_tile rows
      thread_local slice::Int8Rows xq;
      xq.quantize(x, rows, in, qtype);
      const int64_t items = (out + slice::gguf_tile - 1) / slice::gguf_tile;
      work.run(job, items, std::max<int64_t>(1, items / (8 * work.threads())), t,
               [&](int64_t b, int64_t e) {
                 slice::gguf_linear_int8(xq, blocks, row_bytes, out, bias, y, out, b, e);
               });
      return;
    }
    if (blocks != nullptr) {  // units of slice::gguf_unit(rows) output rows, on the blocks
      const int64_t items = (out + slice::gguf_unit(rows) - 1) / slice::gguf_unit(rows);
      const int64_t chunk = std::max<int64_t>(1, items / (8 * work.threads()));
      work.run(job, items, chunk, t, [&](int64_t b, int64_t e) {
        slice::gguf_linear(x, rows, in, blocks, row_bytes, qtype, out, bias, y, out, b, e);
      });
      return;
    }
    const slice::PanelLayout layout = silu     ? slice::PanelLayout::kHalvesSiluAndMul
                                      : halves ? slice::PanelLayout::kHalves
                                               : slice::PanelLayout::kColumns;
    const int64_t width = rows == 1 ? slice::matvec_group_size : slice::panel_width;
    const int64_t items = (out + width - 1) / width;
    const int64_t chunk = std::max<int64_t>(1, items / (8 * work.threads()));
    work.run(job, items, chunk, t, [&](int64_t b, int64_t e) {
      if (rows == 1) slice::matvec(x, weight, in, out, bias, y, b, e);
      else slice::packed_linear(x, rows, in, panels, out, bias, y, b, e, layout);
    });
  }
};

// One linear layer's LoRA factors as raw pointers (cpu/lora.py's twin): A
// [S, r, in] contiguous, B [S, out, r] stored as [S, r, out].
// out_slices: a fused layer's module output sizes (its B is block-diagonal).
struct LoRALinear {
  const float *a, *bt;
  int64_t r, in, out;
  std::vector<int64_t> slice_ends;

  LoRALinear(const at::Tensor& A, const at::Tensor& B, int64_t in_features, int64_t out_features,
             std::vector<int64_t> out_slices, const std::string& what)
      : r(A.size(1)), in(in_features), out(out_features) {
    const int64_t S = A.size(0);
    TORCH_CHECK(A.scalar_type() == at::kFloat && A.is_contiguous() &&
                    A.sizes() == at::IntArrayRef({S, r, in}),
                "llama_decode_forward: ", what, " lora_a must be contiguous float32 [slots, rank, ",
                in, "], got ", A.scalar_type(), " ", A.sizes());
    TORCH_CHECK(B.scalar_type() == at::kFloat && B.sizes() == at::IntArrayRef({S, out, r}) &&
                    B.transpose(1, 2).is_contiguous(),
                "llama_decode_forward: ", what, " lora_b must be float32 [", S, ", ", out, ", ",
                r, "] stored as [slots, rank, out] (minivllm/cpu/lora.py), got ",
                B.scalar_type(), " ", B.sizes(), " strides ", B.strides());
    a = A.data_ptr<float>();
    bt = B.data_ptr<float>();
    slice_ends = slice::lora_slice_ends(out_slices, out, r, "llama_decode_forward");
  }
};

// Is every linear layer's product at `tokens` rows one of our own kernels
// (float32 panels, or GGUF blocks), so the step needs no MKL?
bool own_product(const at::Tensor* w, int64_t tokens) {
  if (w[0].scalar_type() == at::kByte) return tokens <= slice::gguf_max_rows;
  return w[1].numel() > 0;
}

bool all_panels(at::TensorList weights, int64_t tokens) {
  for (size_t i = 0; i < weights.size(); i += kTensorsPerLayer)
    for (size_t j : {1, 5, 10, 14})
      if (!own_product(weights.data() + i + j, tokens)) return false;
  return true;
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
                const at::Tensor& cos_cache, const at::Tensor& k_cache, int64_t tokens) {
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
  check_block_tables(block_tables, seq_lens, tokens, k_cache.size(0), k_cache.size(1));
}

at::Tensor decode_in_one_region(at::Tensor hidden, at::Tensor positions, at::Tensor slot_mapping,
                                at::Tensor block_tables, at::Tensor seq_lens,
                                const at::Tensor& cos_cache,
                                const at::Tensor& sin_cache, at::TensorList k_caches,
                                at::TensorList v_caches, at::TensorList weights,
                                const at::Tensor& final_norm, at::TensorList lm_head,
                                int64_t heads, int64_t kv_heads, int64_t dim, float eps,
                                float scale, bool gate_up_halves, at::TensorList lora_weights,
                                const LoRAGroups* lora_groups) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  const int64_t T = hidden.size(0), E = hidden.size(1);
  const int64_t q_size = heads * dim, kv_size = kv_heads * dim, qkv_size = q_size + 2 * kv_size;
  const int64_t inter = weights[10].size(0) / 2;  // gate_up_proj's [gate; up] rows
  check_f32(hidden, {T, E}, "hidden");
  check_f32(final_norm, {E}, "final_norm");
  check_f32(sin_cache, cos_cache.sizes(), "sin_cache");
  check_f32(cos_cache, {cos_cache.size(0), dim}, "cos_cache");
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
  slot_mapping = slot_mapping.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  check_step(positions, slot_mapping, block_tables, seq_lens, cos_cache, kc0, T);
  std::vector<Linear> qkv, o, gate_up, down;
  std::vector<const float*> in_norm, post_norm;

  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kTensorsPerLayer;
    check_f32(w[0], {E}, "input_layernorm weight");
    check_f32(w[9], {E}, "post_attention_layernorm weight");
    in_norm.push_back(f32(w[0]));
    post_norm.push_back(f32(w[9]));
    const std::string layer = "layer " + std::to_string(i) + " ";
    qkv.emplace_back(w + 1, E, qkv_size, layer + "qkv_proj");
    o.emplace_back(w + 5, q_size, E, layer + "o_proj");
    gate_up.emplace_back(w + 10, E, 2 * inter, layer + "gate_up_proj");
    gate_up.back().halves = gate_up_halves;
    down.emplace_back(w + 14, inter, E, layer + "down_proj");
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
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float *cos = f32(cos_cache), *sin = f32(sin_cache), *final_w = f32(final_norm);
  at::Tensor logits = head ? at::empty({T, head->out}, options) : at::Tensor();
  float *outp = f32(out), *logitsp = head ? f32(logits) : nullptr;
  const int64_t block_size = cache_shape[1], width = block_tables.size(1);
  SpinBarrier barrier;
  // 5 jobs a layer: 4 products and the attention; then the LM head. (Should
  // OpenMP start fewer threads than asked for, the shares of the missing ones
  // are taken as leftovers.)
  // With LoRA, then 2 jobs per product: the shrink and the expand.
  SharedWork work(5 * layers + 1 + 2 * static_cast<int64_t>(lora.size()), at::get_num_threads());
  // More than one row takes the panel kernel, whose epilogue can do SiLU-and-mul
  // when gate_up's panels are in halves (one row takes matvec: a pass after it);
  // not with LoRA, whose delta joins [gate | up] before the SiLU.
  const bool fuse_silu = gate_up_halves && T > 1 && lora.empty();
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
    for (int64_t i = 0; i < layers; ++i) {
      // Pre-norm residual blocks; the residual add is fused into the next norm.
      if (i == 0) slice::rms_norm(res, E, nullptr, in_norm[i], xp, E, eps, rows.begin, rows.end);
      else slice::rms_norm(hp, E, res, in_norm[i], xp, E, eps, rows.begin, rows.end);
      barrier.wait();
      qkv[i].run(xp, T, qkvp, work, 5 * i + 0, t);
      lora_shrink(i, 0, xp);
      barrier.wait();
      lora_expand(i, 0, qkvp, qkv_size);
      float *q = qkvp, *k = qkvp + q_size, *v = k + kv_size;
      slice::rotary_embedding(pos, q, qkv_size, heads, k, qkv_size, kv_heads, cos, sin, dim,
                              rows.begin, rows.end);
      slice::reshape_and_cache(k, qkv_size, v, qkv_size, kc[i], vc[i], slots, kv_heads, dim,
                               rows.begin, rows.end);
      barrier.wait();
      // (sequence, KV head) items, a few at a time (contexts differ in length);
      // within a chunk each item prefetches the next one's first block.
      work.run(5 * i + 4, items, item_chunk, t, [&](int64_t b, int64_t e) {
        slice::paged_decode_attention(q, qkv_size, kc[i], vc[i], tables, lens, attnp, heads,
                                      kv_heads, dim, block_size, width, scale, b, e);
      });
      barrier.wait();
      o[i].run(attnp, T, hp, work, 5 * i + 1, t);
      lora_shrink(i, 1, attnp);
      barrier.wait();
      lora_expand(i, 1, hp, E);
      slice::rms_norm(hp, E, res, post_norm[i], xp, E, eps, rows.begin, rows.end);
      barrier.wait();
      if (fuse_silu) {
        // The panels hold gate and up columns side by side: the product's
        // epilogue applies SiLU-and-mul, so no pass over [gate | up] follows.
        gate_up[i].run(xp, T, actp, work, 5 * i + 2, t, /*silu=*/true);
        barrier.wait();
      } else {
        gate_up[i].run(xp, T, gup, work, 5 * i + 2, t);
        lora_shrink(i, 2, xp);
        barrier.wait();
        lora_expand(i, 2, gup, 2 * inter);
        // Element-wise: split by columns, so a single row uses every thread.
        slice::silu_and_mul(gup, actp, T, inter, cols.begin, cols.end);
        barrier.wait();
      }
      down[i].run(actp, T, hp, work, 5 * i + 3, t);
      lora_shrink(i, 3, actp);
      barrier.wait();
      lora_expand(i, 3, hp, E);
    }
    slice::rms_norm(hp, E, res, final_w, outp, E, eps, rows.begin, rows.end);
    if (head) {
      barrier.wait();
      head->run(outp, T, logitsp, work, 5 * layers, t);
    }
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
at::Tensor llama_decode_forward(at::Tensor hidden, at::Tensor positions,
                                at::Tensor slot_mapping, at::Tensor block_tables,
                                at::Tensor seq_lens, at::Tensor cos_cache, at::Tensor sin_cache,
                                at::TensorList k_caches, at::TensorList v_caches,
                                at::TensorList weights, at::Tensor final_norm,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                double eps, double scale, int64_t panel_max_rows,
                                at::TensorList lm_head, int64_t lm_head_panel_max_rows,
                                bool gate_up_halves, at::TensorList lora_weights,
                                c10::optional<at::Tensor> token_lora_indices) {
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
  std::optional<LoRAGroups> lora;
  if (!lora_weights.empty()) {
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
        hidden, positions, slot_mapping, block_tables, seq_lens, cos_cache, sin_cache, k_caches,
        v_caches, weights, final_norm, head_inside ? lm_head : at::TensorList(), num_heads,
        num_kv_heads, head_dim, static_cast<float>(eps), static_cast<float>(scale),
        gate_up_halves, lora ? lora_weights : at::TensorList(), lora ? &*lora : nullptr);
    if (head_inside || lm_head.empty()) return out;
    return linear(out, lm_head.data(), lm_head_panel_max_rows);
  }
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor residual = hidden, h;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kTensorsPerLayer;
    // Pre-norm residual blocks; the residual add is fused into the next norm.
    at::Tensor x = i == 0 ? rms_norm(hidden, w[0], eps) : fused_add_rms_norm(h, residual, w[0], eps);
    at::Tensor qkv =
        with_lora(linear(x, w + 1, panel_max_rows), x, i, 0, {q_size, kv_size, kv_size});
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    rotary_embedding(positions, q, k, cos_cache, sin_cache);
    reshape_and_cache(k, v, k_caches[i], v_caches[i], slot_mapping);
    at::Tensor attn = paged_decode_attention(q, k_caches[i], v_caches[i], block_tables, seq_lens,
                                             scale);
    at::Tensor a = attn.view({tokens, q_size});
    h = with_lora(linear(a, w + 5, panel_max_rows), a, i, 1);
    x = fused_add_rms_norm(h, residual, w[9], eps);
    const int64_t inter = w[10].size(0) / 2;  // (w[14] may be quantized blocks)
    at::Tensor act = silu_and_mul(
        with_lora(linear(x, w + 10, panel_max_rows, gate_up_halves), x, i, 2, {inter, inter}));
    h = with_lora(linear(act, w + 14, panel_max_rows), act, i, 3);
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
        "bool gate_up_halves, Tensor[] lora_weights, Tensor? token_lora_indices) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("llama_decode_forward", &minivllm::llama_decode_forward);
}

// oneDNN's packed bfloat16 weights are MkldnnCPU tensors: a weight list that
// holds them dispatches here.
TORCH_LIBRARY_IMPL(minivllm, MkldnnCPU, m) {
  m.impl("llama_decode_forward", &minivllm::llama_decode_forward);
}
