// The panel GEMM's micro-kernel, shared by gemm.cpp (float32 weights packed
// once into panels) and gguf_gemm.cpp (GGUF blocks dequantized one panel at a
// time into the same layout): with the same kernel and the same order over K,
// a quantized batch's outputs are bit for bit the float path's on the
// dequantized weights.
//
// A panel is NR output columns (two vectors) of W [N, K] stored [K][NR]
// contiguous, so the kernel reads it front to back. Rows of x are taken MR at
// a time (2 * MR accumulators: MR rows x two column vectors), each x value
// broadcast against the panel's two weight vectors; what the register file
// allows: AVX-512's 32 zmm registers hold 12 rows (24 accumulators), AVX2's 16
// ymm registers 6 (12 accumulators, 2 weight vectors, 1 broadcast row value).
#pragma once

#include <array>
#include <utility>

#include "cpu_types.h"
#include "ops.h"

#ifdef MINIVLLM_VEC
namespace minivllm {
namespace panel {

constexpr int64_t NR = slice::panel_width;  // output columns per panel: two vectors
using vec::vf;
constexpr int64_t L = vec::kLanes;  // NR / 2
static_assert(NR == 2 * L, "a panel is two vectors wide");
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

// rows x NR outputs of one panel. Meanwhile it prefetches its share of what
// the next panel needs: `next` points at that share, `step` floats further
// each k (a panel's row tiles split the next panel between them, so the
// prefetches are spread over the whole time the panel is being multiplied).
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

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, int64_t,
                        const PanelOut&);
// kTiles[r]: the tile of r rows, r = 1 .. MR.
template <int... R>
constexpr std::array<TileFn, sizeof...(R) + 1> tiles(std::integer_sequence<int, R...>) {
  return {nullptr, tile<R + 1>...};
}
constexpr auto kTiles = tiles(std::make_integer_sequence<int, MR>());

// All M rows of x (row stride K) times one panel, MR rows a tile. The tiles
// split the prefetch of `next_floats` floats at `next` between them; `step`
// (floats a k) as tile() takes it, 0: as many as spread them over K.
inline void multiply_panel(const float* x, int64_t M, int64_t K, const float* panel,
                           const float* next, int64_t next_floats, int64_t step, PanelOut out) {
  const int64_t tiles = (M + MR - 1) / MR, share = next_floats / tiles;
  if (step == 0) step = std::max<int64_t>(1, (share + K - 1) / K);
  for (int64_t m = 0, i = 0; m < M; m += MR, ++i) {
    const int64_t rows = std::min(MR, M - m);
    kTiles[rows](x + m * K, K, panel, K, next + i * share, step, out);
    out.y0 += MR * out.ldy;
    out.y1 += MR * out.ldy;
  }
}

}  // namespace panel
}  // namespace minivllm
#endif  // MINIVLLM_VEC
