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

#include <array>
#include <utility>

#include "cpu_types.h"
#include "ops.h"

namespace minivllm {
namespace {

constexpr int64_t NR = slice::panel_width;  // output columns per panel: two vectors

#ifdef MINIVLLM_VEC
using vec::vf;
constexpr int64_t L = vec::kLanes;  // NR / 2
static_assert(NR == 2 * L, "a panel is two vectors wide");
// Rows per register tile: 2 * MR accumulators, 2 weight vectors and the
// broadcast row value fit in the register file (32 zmm: 12 rows; 16 ymm: 6).
constexpr int64_t MR = vec::kRegisters == 32 ? 12 : 6;
static_assert(2 * MR + 3 <= vec::kRegisters, "the tile must fit in the registers");

// Where one panel's NR outputs go: two L-column halves, y0 and y1 (row
// stride ldy), each with its bias (or none), the last ncols <= NR of them
// valid; or, with silu, the single output silu(half 0) * half 1 at y0.
struct PanelOut {
  float *y0, *y1;
  int64_t ldy;
  const float *b0, *b1;
  int64_t ncols;
  bool silu;
};

// rows x NR outputs of one panel. Meanwhile it prefetches its share of the
// next panel: `next` points at that share, `step` floats further each k (a
// panel's row tiles split its next panel between them, so the prefetches are
// spread over the whole time the panel is being multiplied).
template <int R>
void tile(const float* x, int64_t ldx, const float* panel, int64_t K, const float* next,
          int64_t step, const PanelOut& out) {
  vf acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    const vf w0 = vec::load(panel + k * NR);
    const vf w1 = vec::load(panel + k * NR + L);
    _mm_prefetch(reinterpret_cast<const char*>(next + k * step), _MM_HINT_T1);
    if (step > 16) _mm_prefetch(reinterpret_cast<const char*>(next + k * step + 16), _MM_HINT_T1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const vf xr = vec::set1(x[r * ldx + k]);
      acc[r][0] = vec::fmadd(xr, w0, acc[r][0]);
      acc[r][1] = vec::fmadd(xr, w1, acc[r][1]);
    }
  }
  // The last panel may be narrower than NR columns: masked loads and stores.
  const vec::mask m0 = vec::first(out.ncols), m1 = vec::first(out.ncols - L);
  const vf b0 = out.b0 != nullptr ? vec::load(out.b0, m0, vec::zero()) : vec::zero();
  const vf b1 = out.b1 != nullptr ? vec::load(out.b1, m1, vec::zero()) : vec::zero();
  for (int r = 0; r < R; ++r) {
    const vf h0 = vec::add(acc[r][0], b0), h1 = vec::add(acc[r][1], b1);
    if (out.silu) {  // (the halves layout: always L + L columns)
      alignas(64) float gate[L], up[L];
      vec::store(gate, h0);
      vec::store(up, h1);
      silu_and_mul_row(gate, up, out.y0 + r * out.ldy, L);
    } else {
      vec::store(out.y0 + r * out.ldy, h0, m0);
      vec::store(out.y1 + r * out.ldy, h1, m1);
    }
  }
}

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

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, int64_t,
                        const PanelOut&);
// kTiles[r]: the tile of r rows, r = 1 .. MR.
template <int... R>
constexpr std::array<TileFn, sizeof...(R) + 1> tiles(std::integer_sequence<int, R...>) {
  return {nullptr, tile<R + 1>...};
}
constexpr auto kTiles = tiles(std::make_integer_sequence<int, MR>());
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
    const float* panel = packed + p * K * NR;
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
    const int64_t tiles = (M + MR - 1) / MR, share = K * NR / tiles;
    const int64_t step = tiles == 1 ? NR : 16;
    for (int64_t m = 0, i = 0; m < M; m += MR, ++i) {
      const int64_t rows = std::min(MR, M - m);
      kTiles[rows](x + m * K, K, panel, K, next + i * share, step, out);
      out.y0 += MR * out.ldy;
      out.y1 += MR * out.ldy;
    }
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
