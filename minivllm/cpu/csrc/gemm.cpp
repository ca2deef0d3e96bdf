// float32 matrix products for decode-sized batches: y = x W^T (+ bias), with W
// packed once into column panels.
//
// With a few dozen rows, a decode step's products are neither purely
// compute-bound nor purely memory-bound: every weight is streamed from DRAM
// once and used by each row. MKL's packed GEMM does them one after the other
// (wait for weights, then compute); this kernel overlaps the two. W [N, K] is
// stored as panels of NR output columns (two vectors wide: 32 with AVX-512,
// 16 with AVX2), each panel [K][NR] contiguous, so the inner loop reads the
// weights strictly front to back. While one panel is multiplied with the rows
// (kept in 2 * MR vector registers: MR rows x two column vectors), the next
// panel is prefetched into L2, so memory traffic proceeds during the
// arithmetic instead of between it. MR is what the register file allows:
// AVX-512's 32 zmm registers hold 12 rows (24 accumulators); AVX2's 16 ymm
// registers hold 6 (12 accumulators, 2 weight vectors, 1 broadcast row value).
//
// An MLP's [gate; up] weight can be packed "in halves": panel p then holds
// gate columns (NR / 2)p .. (NR / 2)(p + 1) - 1 and the same up columns, so one
// tile has the gate and the up value of the same outputs in its two
// accumulators. The
// product's output is the same (each column is the same chain of products);
// the fused decode step (llama_decode.cpp) also uses it to apply
// SiLU-and-mul in the epilogue, instead of writing [gate | up] out and
// reading it back in a pass of its own.
//
// One row is a different problem (`matvec` below): each weight is used once,
// so the product is a pure stream over the row-major weight, and what counts
// is keeping enough loads in flight.
//
// AVX-512 or AVX2 + FMA (vec in cpu_types.h): elsewhere
// packed_linear_available() is false and the caller keeps using MKL.
#include <ATen/Parallel.h>

#include "cpu_types.h"
#include "ops.h"
#include "panel_gemm.h"  // the micro-kernel (tile) and its output (PanelOut)

namespace minivllm {
namespace {

constexpr int64_t NR = slice::panel_width;  // output columns per panel: two vectors

#ifdef MINIVLLM_VEC
using vec::vf;
using panel::PanelOut;
constexpr int64_t L = vec::kLanes;  // NR / 2

// ROWS (<= 4) rows of W times x: the weight rows read side by side, each
// prefetched four rows ahead when PREFETCH (the hardware prefetcher alone
// leaves the memory bus partly idle). The last K % L take masked loads.
template <int ROWS, bool PREFETCH>
void matvec_rows(const float* w, const float* x, int64_t K, float* y) {
  vf acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = vec::zero();
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    const vf xv = vec::load(x + k);
    for (int r = 0; r < ROWS; ++r) {
      // (With 8 lanes, every other prefetch names the line before again: cheap.)
      if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(w + (r + 4) * K + k), _MM_HINT_T0);
      acc[r] = vec::fmadd(vec::load(w + r * K + k), xv, acc[r]);
    }
  }
  if (k < K) {
    const vec::mask tail = vec::first(K - k);
    const vf xv = vec::load(x + k, tail, vec::zero());
    for (int r = 0; r < ROWS; ++r)
      acc[r] = vec::fmadd(vec::load(w + r * K + k, tail, vec::zero()), xv, acc[r]);
  }
  for (int r = 0; r < ROWS; ++r) y[r] = vec::reduce_add(acc[r]);
}

#endif

void check_packed(const at::Tensor& packed, const char* op) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              op, ": packed weight must come from pack_linear_weight (float32 [panels, K, ",
              NR, "])");
}

// The optional bias of an N-output product as a pointer (nullptr: none).
const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                  bias->scalar_type() == at::kFloat,
              op, ": bias must be a contiguous float32 [", N, "], got ", bias->scalar_type(),
              " ", bias->sizes());
  return bias->data_ptr<float>();
}

}  // namespace

bool packed_linear_available() {
#ifdef MINIVLLM_VEC
  return true;
#else
  return false;
#endif
}

int64_t panel_width() { return NR; }

// W [N, K] float32 -> panels [ceil(N / NR), K, NR], zero-padded past N. With
// halves (W = [A; B], two halves of N / 2 rows, a multiple of NR / 2), panel p
// holds A's columns (NR / 2)p .. (NR / 2)(p + 1) - 1 and then B's same columns
// instead: the gate and the up projection of the same outputs side by side,
// for the SiLU epilogue.
at::Tensor pack_linear_weight(at::Tensor weight, bool halves) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_linear_weight: weight must be a 2-D float32 CPU tensor, got ",
              weight.scalar_type(), " ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + NR - 1) / NR;
  if (halves) {
    TORCH_CHECK(N % NR == 0, "pack_linear_weight: halves need out_features a multiple of ",
                NR, " (two halves of whole ", NR / 2, "-column groups), got ", N);
    // [2, N/NR, NR/2, K] -> [N/NR, 2, NR/2, K]: A's rows, B's rows, panel by panel.
    weight = weight.reshape({2, panels, NR / 2, K}).transpose(0, 1).reshape({N, K});
  }
  auto padded = at::zeros({panels * NR, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  // [panels, NR, K] -> [panels, K, NR]
  return padded.view({panels, NR, K}).transpose(1, 2).contiguous();
}

at::Tensor packed_linear(at::Tensor x, at::Tensor packed, int64_t out_features,
                         c10::optional<at::Tensor> bias, bool halves) {
  check_cpu(x, "packed_linear", "x");
  check_packed(packed, "packed_linear");
  TORCH_CHECK(packed_linear_available(), "packed_linear: this build has neither AVX-512 nor AVX2 + FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == packed.size(1),
              "packed_linear: x must be float32 [rows, ", packed.size(1), "], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features, panels = packed.size(0);
  TORCH_CHECK(N > (panels - 1) * NR && N <= panels * NR, "packed_linear: out_features ", N,
              " does not match the packed weight's ", panels, " panels");
  TORCH_CHECK(!halves || N % NR == 0, "packed_linear: halves need out_features a multiple of ",
              NR, ", got ", N);
  const float* bp = bias_data(bias, N, "packed_linear");
  x = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
    slice::packed_linear(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), N, bp,
                         y.data_ptr<float>(), b, e,
                         halves ? slice::PanelLayout::kHalves : slice::PanelLayout::kColumns);
  });
  return y;
}

void slice::packed_linear(const float* x, int64_t M, int64_t K, const float* packed, int64_t N,
                          const float* bias, float* y, int64_t begin, int64_t end,
                          PanelLayout layout) {
#ifdef MINIVLLM_VEC
  const int64_t panels = (N + NR - 1) / NR, half = N / 2;
  for (int64_t p = begin; p < end; ++p) {
    const float* here = packed + p * K * NR;
    const float* next = packed + std::min(p + 1, panels - 1) * K * NR;
    // Panel p's two L-column halves: columns NR p and NR p + L, or with
    // halves, column L p of each half of the output.
    const int64_t c0 = layout == PanelLayout::kColumns ? p * NR : p * (NR / 2);
    const int64_t c1 = layout == PanelLayout::kColumns ? c0 + NR / 2 : half + c0;
    const bool silu = layout == PanelLayout::kHalvesSiluAndMul;
    PanelOut out{y + c0, y + c1, silu ? half : N, bias != nullptr ? bias + c0 : nullptr,
                 bias != nullptr ? bias + c1 : nullptr, std::min(NR, N - p * NR), silu};
    // Tile i of T prefetches the i-th T-th of the next panel: its K NR / 16
    // cache lines spread over T * K iterations, one line (16 floats) per
    // iteration, two for a single tile of 32-column panels.
    const int64_t tiles = (M + panel::MR - 1) / panel::MR;
    panel::multiply_panel(x, M, K, here, next, K * NR, tiles == 1 ? NR : 16, out);
  }
#endif
}

// y [1, N] = x [1, K] W^T (+ bias), W the ordinary row-major [N, K] weight.
at::Tensor matvec(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  check_cpu(x, "matvec", "x");
  TORCH_CHECK(packed_linear_available(), "matvec: this build has neither AVX-512 nor AVX2 + FMA");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "matvec: weight must be a contiguous float32 [N, K], got ", weight.scalar_type(),
              " ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.size(1) == K && x.scalar_type() == at::kFloat,
              "matvec: x must be float32 [1, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  const float* bp = bias_data(bias, N, "matvec");
  x = x.contiguous();
  auto y = at::empty({1, N}, x.options());
  const int64_t groups = (N + slice::matvec_group_size - 1) / slice::matvec_group_size;
  at::parallel_for(0, groups, 1, [&](int64_t b, int64_t e) {
    slice::matvec(x.data_ptr<float>(), weight.data_ptr<float>(), K, N, bp, y.data_ptr<float>(),
                  b, e);
  });
  return y;
}

void slice::matvec(const float* x, const float* weight, int64_t K, int64_t N, const float* bias,
                   float* y, int64_t begin, int64_t end) {
  static_assert(matvec_group_size == 4, "matvec_rows streams four weight rows at a time");
#ifdef MINIVLLM_VEC
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = 4 * i, rows = std::min<int64_t>(4, N - r);
    const float* w = weight + r * K;
    if (r + 8 <= N) matvec_rows<4, true>(w, x, K, y + r);
    else if (rows == 4) matvec_rows<4, false>(w, x, K, y + r);  // no prefetch
    else if (rows == 3) matvec_rows<3, false>(w, x, K, y + r);  // past the end
    else if (rows == 2) matvec_rows<2, false>(w, x, K, y + r);
    else matvec_rows<1, false>(w, x, K, y + r);
    if (bias != nullptr)
      for (int64_t j = r; j < r + rows; ++j) y[j] += bias[j];
  }
#endif
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("packed_linear_available() -> bool");
  m.def("panel_width() -> int");
  m.def("pack_linear_weight(Tensor weight, bool halves=False) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, "
        "bool halves=False) -> Tensor");
  m.def("matvec(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("pack_linear_weight", &minivllm::pack_linear_weight);
  m.impl("packed_linear", &minivllm::packed_linear);
  m.impl("matvec", &minivllm::matvec);
}

TORCH_LIBRARY_IMPL(minivllm, CompositeExplicitAutograd, m) {
  m.impl("packed_linear_available", &minivllm::packed_linear_available);
  m.impl("panel_width", &minivllm::panel_width);
}
