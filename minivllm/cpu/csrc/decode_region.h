// The machinery of llama_decode.cpp's one parallel region per float32 step:
// the threads' spinning barrier, how they share out each kernel's work, and
// the linear layers (and their LoRA factors) as raw pointers with their
// products over a share of the output columns. Included by llama_decode.cpp
// only (its declarations are internal to that file).
#pragma once

#include <immintrin.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "cpu_types.h"
#include "ops.h"

namespace minivllm {
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

}  // namespace
}  // namespace minivllm
