// Products with GGUF-quantized weights, read as they ship: y = x W^T (+ bias),
// W given as [N, row_bytes] bytes of one GGML block type (see
// minivllm/model/layers/quantization/ggml_types.py for the formats).
//
// A decode step is bandwidth-bound: what it costs is the bytes of the weights
// it streams. So the weights stay in their blocks in memory (0.63 bytes a
// weight for Q4_1, 1.06 for Q8_0, against 4 for float32) and are turned into
// floats in vector registers as they are used (gguf_blocks.h's groups; its
// block-at-a-time path where the build has no AVX2). The arithmetic of a
// block is the reference's, in the same order and rounding (no fused
// multiply-add in the dequantization), so the weights it multiplies are bit
// for bit the float path's; only the summation order of the dot products
// differs, as with any change of GEMM kernel.
//
// A few rows (2 .. gguf_wide_rows - 1: a verify step of speculative decoding,
// a small batch) read the weights once too: each block is turned into floats
// once and used for every row, so a step of 5 rows streams the bytes of a
// step of one. Each output is summed in the one-row product's order, so a
// row's numbers do not depend on the other rows of its step.
//
// gguf_dequantize writes a whole matrix out (gguf_linear's large batches then
// take MKL's GEMM on it).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <vector>

#include "cpu_types.h"
#include "gguf_blocks.h"
#include "ops.h"
#include "panel_gemm.h"

namespace minivllm {
namespace {

using namespace gguf;

#ifdef MINIVLLM_VEC

// Output rows are taken kTile at a time: one row of x then meets kTile weight
// rows per load (and kTile independent sums hide the FMA latency).
constexpr int64_t kTile = 4;

// Every output y[m, n] is one vector sum over k in steps of L (k ascending),
// then reduce_add, then the bias: the same order whatever the number of x
// rows or the tile an output falls in, so a decode step's numbers do not
// depend on how many sequences share it or how the rows are split.

// Group g of a block as floats in registers, Fmt<T>::group's numbers:
// load(b, g) takes the block's numbers, w[c] is then vector c (of G) of its
// weights. The default file's types, where the build has F16C, convert d
// (and m) with it (the same IEEE conversion as f16(), one instruction
// instead of a dozen scalar ones) and make each vector only when it is used
// (a few-row product keeps one vector per weight row in registers, not G);
// every other type holds the G vectors Fmt<T>::group made. The one-row and
// the few-row products both take their weights from here: the same numbers.
template <int64_t T> struct Group {
  vf wv[G];
  inline void load(const uint8_t* b, int g) { Fmt<T>::group(b, g, wv); }
  inline vf operator[](int c) const { return wv[c]; }
};

#ifdef __F16C__
// The float16 pair at p (d and m of a Q4_1 block; d and the next two bytes of the others).
inline __m128 f16_pair(const uint8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}
// Lane 0 of v in every lane.
inline vf broadcast0(__m128 v) {
#ifdef __AVX512F__
  return _mm512_broadcastss_ps(v);
#else
  return _mm256_broadcastss_ps(v);
#endif
}
template <> struct Group<Q4_0> {
  const uint8_t* qs;
  vf d;
  inline void load(const uint8_t* b, int) { qs = b + 2, d = broadcast0(f16_pair(b)); }
  inline vf operator[](int c) const { return vec::mul(d, to_f(subi(nibbles(qs, c), 8))); }
};
template <> struct Group<Q4_1> {
  const uint8_t* qs;
  vf d, m;
  inline void load(const uint8_t* b, int) {
    const __m128 dm = f16_pair(b);
    qs = b + 4, d = broadcast0(dm), m = broadcast0(_mm_movehdup_ps(dm));
  }
  inline vf operator[](int c) const { return vec::add(rounded(vec::mul(d, to_f(nibbles(qs, c)))), m); }
};
template <> struct Group<Q8_0> {
  const uint8_t* qs;
  vf d;
  inline void load(const uint8_t* b, int) { qs = b + 2, d = broadcast0(f16_pair(b)); }
  inline vf operator[](int c) const { return vec::mul(to_f(s8(qs + c * L)), d); }
};
#endif

// One x row: the tile's weights dequantized in registers and used at once.
// A decode step of one sequence spends nearly all its time here, so Q4_1
// (the default file's type) has its own block step below with AVX-512;
// every other type and ISA takes its Group.
template <int64_t T> struct OneRow {
  // acc += group g of block b times xv (G vectors): the weights in order,
  // each FMA'd into the row's one accumulator.
  static inline void step(const uint8_t* b, int g, const vf* xv, vf& acc) {
    Group<T> w;
    w.load(b, g);
    for (int c = 0; c < G; ++c) acc = vec::fmadd(w[c], xv[c], acc);
  }
};

#if defined(__AVX512F__) && defined(__F16C__)
// Q4_1: a block's 32 weights take only 16 values, d * q + m for q = 0..15.
// Those 16 floats are made once (one multiply, one add, the reference's
// rounding), and vpermps picks each weight's from the low 4 bits of its
// lane: no per-weight conversion, multiply or add. The same numbers as
// Fmt<Q4_1>::group, in the same lanes. The blocks' d and m come from
// Q4_1Heads (below), as floats in memory: broadcasting one from memory is a
// load, while converting and broadcasting it in registers takes the shuffle
// port that the two permutes already fill, and that port bounds this loop.
struct Q4_1Heads {
  alignas(64) float d[16], m[16];
  // The d and m of `count` (<= 16) blocks from `b` on, 20 bytes apart: one
  // gather and two conversions (F16C's, as f16()) for 16 blocks. (A gather,
  // unlike gguf_int8.cpp's chunks, where block_heads' loads and permutes win:
  // here the permute port is the one this loop is short of.)
  void load(const uint8_t* b, int64_t count) {
    const __m512i at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(20));
    const __mmask16 live = count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
    const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, b, 1);
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
    _mm512_store_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
  }
};

template <> struct OneRow<Q4_1> {
  static inline void step(const uint8_t* b, float d, float m, const vf* xv, vf& acc) {
    const __m512 iota =
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table =
        _mm512_add_ps(rounded(_mm512_mul_ps(_mm512_set1_ps(d), iota)), _mm512_set1_ps(m));
    const vi q = u8(b + 4);  // byte i: weight i (low nibble), weight i + 16 (high)
    acc = vec::fmadd(_mm512_permutexvar_ps(q, table), xv[0], acc);
    acc = vec::fmadd(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table), xv[1], acc);
  }
};
#endif

// Software prefetch distance of the one-row product, in tiles. A thread's
// rows are one contiguous stream of blocks; the hardware prefetcher alone
// keeps too few lines in flight for it (half the bandwidth on a Zen 5), a
// burst for the next tile only starts too late. Each row prefetches its line
// kPrefetchTiles tiles ahead as it goes (4: best of 1-16 measured), with
// the hint that suits the CPU's caches (prefetch_stream, cpu_types.h): each
// weight is used once, and the ~100 MB a step streams should not push out of
// the caches what the Python step between two decode steps works on.
constexpr int64_t kPrefetchTiles = 4;

template <int64_t T>
void one_row_tile(const float* x, int64_t K, const uint8_t* const* w, int64_t ahead,
                  float* acc_out) {
  using F = Fmt<T>;
  vf acc[kTile];
  for (int r = 0; r < kTile; ++r) acc[r] = vec::zero();
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t blk = (k / F::block) * F::bytes;
    const int g = static_cast<int>((k % F::block) / 32);
    vf xv[G];
    for (int c = 0; c < G; ++c) xv[c] = vec::load(x + k + c * L);
    for (int r = 0; r < kTile; ++r) prefetch_stream(w[r] + blk + ahead);
    for (int r = 0; r < kTile; ++r) OneRow<T>::step(w[r] + blk, g, xv, acc[r]);
  }
  for (int r = 0; r < kTile; ++r) acc_out[r] = vec::reduce_add(acc[r]);
}

#if defined(__AVX512F__) && defined(__F16C__)
// Q4_1 (the default file's): each row's block heads taken 16 blocks at a time.
template <>
void one_row_tile<Q4_1>(const float* x, int64_t K, const uint8_t* const* w, int64_t ahead,
                        float* acc_out) {
  constexpr int64_t bytes = block_bytes(Q4_1);
  vf acc[kTile];
  Q4_1Heads heads[kTile];
  for (int r = 0; r < kTile; ++r) acc[r] = vec::zero();
  for (int64_t j = 0; j < K / 32; ++j) {
    const int64_t blk = j * bytes, h = j % 16;
    if (h == 0)
      for (int r = 0; r < kTile; ++r) heads[r].load(w[r] + blk, K / 32 - j);
    const vf xv[2] = {vec::load(x + 32 * j), vec::load(x + 32 * j + L)};
    for (int r = 0; r < kTile; ++r) prefetch_stream(w[r] + blk + ahead);
    for (int r = 0; r < kTile; ++r) OneRow<Q4_1>::step(w[r] + blk, heads[r].d[h], heads[r].m[h], xv, acc[r]);
  }
  for (int r = 0; r < kTile; ++r) acc_out[r] = vec::reduce_add(acc[r]);
}
#endif

// A few x rows (a verify step of speculative decoding: k + 1 rows a request;
// a small batch) against weight rows w[0 .. R): each vector of a block's
// weights is made once in registers and FMA'd into the accumulator of every
// x row, so the weights are read and converted once for all the rows, and
// each output is summed as one_row_tile sums it (one vector sum, k
// ascending, then reduce_add): a row's numbers do not depend on the other
// rows of its step. The M x R accumulators are independent chains of FMAs;
// R is chosen (few_rows_r) so that there are enough of them to hide the
// FMA's latency and few enough to stay in the registers.
template <int64_t T, int M, int R>
void few_rows_tile(const float* x, int64_t K, const uint8_t* const* w, int64_t ahead,
                   float (*sums)[kTile], int64_t r0) {
  using F = Fmt<T>;
  vf acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vec::zero();
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t blk = (k / F::block) * F::bytes;
    const int g = static_cast<int>((k % F::block) / 32);
    Group<T> group[R];
    for (int r = 0; r < R; ++r) {
      prefetch_stream(w[r] + blk + ahead);
      group[r].load(w[r] + blk, g);
    }
    for (int c = 0; c < G; ++c) {
      vf wv[R];
      for (int r = 0; r < R; ++r) wv[r] = group[r][c];
      for (int m = 0; m < M; ++m) {
        const vf xv = vec::load(x + m * K + k + c * L);
        for (int r = 0; r < R; ++r) acc[m][r] = vec::fmadd(wv[r], xv, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) sums[m][r0 + r] = vec::reduce_add(acc[m][r]);
}

// Weight rows a few_rows_tile of M x rows takes: at least 8 accumulators (an
// FMA's latency times the two a cycle a core issues) where the registers
// hold them: AVX2's 16 take 10 beside the weight and x vectors, AVX-512's 32 take 16.
constexpr int few_rows_r(int M) {
  return vec::kRegisters == 32 ? (M <= 4 ? 4 : 2) : (M <= 2 ? 4 : M <= 5 ? 2 : 1);
}

// The tile's `valid` weight rows (of kTile) against M (2 .. gguf_wide_rows - 1) x rows.
template <int64_t T, int M>
void few_rows(const float* x, int64_t K, const uint8_t* const* rows, int64_t valid, int64_t ahead,
              float (*sums)[kTile]) {
  constexpr int R = few_rows_r(M);
  static_assert(kTile % R == 0, "whole few-row passes a tile");
  for (int64_t r0 = 0; r0 < valid; r0 += R) few_rows_tile<T, M, R>(x, K, rows + r0, ahead, sums, r0);
}
static_assert(slice::gguf_wide_rows == 8, "few_rows is instantiated for 2 .. 7 rows (linear_rows)");

// Batches of gguf_wide_rows rows or more: the float panel GEMM's own kernel
// (panel_gemm.h). The weights of one panel (panel_width output rows) are
// dequantized into a thread-local buffer laid out as pack_linear_weight lays
// out a panel ([K][NR], rows past N zero), and every row of x is multiplied
// with it there: the dequantization is paid once per weight for the whole
// batch, and the outputs are bit for bit the float path's on the dequantized
// weights (same kernel, same order over K). No transposed copy of x.
constexpr int64_t kWideRows = slice::gguf_wide_rows;
constexpr int64_t NR = panel::NR;

// Group g (columns 32g .. 32g + 31) of a panel's rows [0, rows) (rows <=
// NR; the rest zero, as the float pack pads) into out [32][NR]: per half of
// the panel, its L rows' groups dequantized into an L1 scratch as rows, then
// each L x L square transposed in registers into the panel's columns.
template <int64_t T>
void fill_group_transposed(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t g,
                           float* out) {
  using F = Fmt<T>;
  const int64_t k = 32 * g, blk = (k / F::block) * F::bytes;
  const int j = static_cast<int>((k % F::block) / 32);
  alignas(64) float scratch[L][32];
  vf wv[G], sq[L];
  for (int64_t h = 0; h < NR; h += L) {  // the panel's two vectors: rows h .. h + L - 1
    for (int64_t r = 0; r < L; ++r) {
      if (h + r < rows) F::group(w + (h + r) * row_bytes + blk, j, wv);
      else for (int c = 0; c < G; ++c) wv[c] = vec::zero();
      for (int c = 0; c < G; ++c) vec::store(scratch[r] + c * L, wv[c]);
    }
    for (int c = 0; c < G; ++c) {
      for (int64_t r = 0; r < L; ++r) sq[r] = vec::load(scratch[r] + c * L);
      vec::transpose(sq);
      for (int64_t i = 0; i < L; ++i) vec::store(out + (c * L + i) * NR + h, sq[i]);
    }
  }
}

// Writes a panel group by group (fill(g, out): group g into out [32][NR]):
// the blocks of output rows [0, rows) at w.
template <int64_t T> struct PanelFill {
  const uint8_t* w;
  int64_t row_bytes, rows;
  PanelFill(const uint8_t* w_, int64_t rb, int64_t n) : w(w_), row_bytes(rb), rows(n) {}
  void operator()(int64_t g, float* out) const { fill_group_transposed<T>(w, row_bytes, rows, g, out); }
};

#ifdef __AVX512F__
// Q4_0 / Q4_1 with AVX-512: the packed bytes are transposed, not the floats.
// A half panel's 16 rows x 16 bytes of nibbles are 4 registers; a 4 x 4
// transpose of 32-bit words in each 128-bit lane makes word c of every row
// one register (row r in lane r), and byte b of it holds weights 4c + b (low
// nibble) and 4c + b + 16 (high). A weight of the 16 rows is then a mask
// (the nibble left in place: q 2^s), a conversion and the block's arithmetic
// per lane, each lane with its own row's d (and m), gathered once: with
// d 2^-s, (q 2^s)(d 2^-s) is exactly the reference's d q, so the same
// rounding and the same bits, and no float transpose.
template <int64_t T> struct Q4Fill {
  static constexpr int64_t qs = T == Q4_1 ? 4 : 2;  // where the nibbles start in a block
  const uint8_t* w;
  int64_t rows;
  int64_t row_at[NR];  // row r's first byte (rows past `rows`: row 0's)
  __m512i offsets;     // row r's byte offset, r = 0 .. 15

  Q4Fill(const uint8_t* w_, int64_t rb, int64_t n) : w(w_), rows(n) {
    for (int64_t r = 0; r < NR; ++r) row_at[r] = r < rows ? r * rb : 0;
    offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                 _mm512_set1_epi32(static_cast<int>(rb)));
  }

  void operator()(int64_t g, float* out) const {
    const uint8_t* block = w + g * Fmt<T>::bytes;
    for (int64_t h = 0; h < NR; h += L, out += L) {
      const int64_t valid = std::min<int64_t>(L, rows - h);
      if (valid <= 0) {  // padding, as the float pack
        for (int i = 0; i < 32; ++i) vec::store(out + i * NR, vec::zero());
        continue;
      }
      // d (and m) of each row: rows past `valid` get 0, so their weights are 0.
      const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), vec::first(valid),
                                                     offsets, block + row_at[h], 1);
      const vf d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
      const vf m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
      auto row = [&](int r) {  // (a padding row reads row 0's bytes; its d is 0)
        return _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + row_at[h + r] + qs));
      };
      __m512i a[4];  // a[i], 128-bit lane l: row 4l + i
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm512_castsi128_si512(row(i));
        a[i] = _mm512_inserti32x4(a[i], row(4 + i), 1);
        a[i] = _mm512_inserti32x4(a[i], row(8 + i), 2);
        a[i] = _mm512_inserti32x4(a[i], row(12 + i), 3);
      }
      const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
      const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
      const __m512i word[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                               _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
#pragma GCC unroll 8
      for (int s = 0; s < 32; s += 4) {  // the nibble at bit s of each word
        const vf ds = vec::mul(d, vec::set1(1.f / static_cast<float>(1u << s)));  // exact
        const __m512i nib = _mm512_set1_epi32(static_cast<int>(0xFu << s));
        const int col = s / 8 + (s % 8 ? 16 : 0);  // byte s/8's weight: low or high nibble
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const vf q = _mm512_cvtepu32_ps(_mm512_and_si512(word[c], nib));  // q 2^s, exact
          const vf wv = T == Q4_1 ? vec::add(rounded(vec::mul(q, ds)), m)
                                  : vec::mul(vec::sub(q, vec::set1(static_cast<float>(8u << s))), ds);
          vec::store(out + (4 * c + col) * NR, wv);
        }
      }
    }
  }
};
template <> struct PanelFill<Q4_0> : Q4Fill<Q4_0> { using Q4Fill<Q4_0>::Q4Fill; };
template <> struct PanelFill<Q4_1> : Q4Fill<Q4_1> { using Q4Fill<Q4_1>::Q4Fill; };
#endif

// Output rows [begin, end) (whole panels, but the last) of y = x W^T + bias.
template <int64_t T>
void linear_rows_panels(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                        int64_t N, const float* bias, float* y, int64_t ldy, int64_t begin,
                        int64_t end) {
  // (Grown, never shrunk or cleared: layers of different K share it.)
  thread_local std::vector<float> storage;
  if (static_cast<int64_t>(storage.size()) < K * NR + 16) storage.resize(K * NR + 16);
  // (+16: room to align the panel to a cache line)
  float* buf = storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) / 4 % 16) % 16;
  for (int64_t n0 = begin; n0 < end; n0 += NR) {
    const int64_t rows = std::min(NR, N - n0);
    const PanelFill<T> fill(w + n0 * row_bytes, row_bytes, rows);
    for (int64_t k = 0; k < K; k += 32) fill(k / 32, buf + k * NR);
    // While this panel is multiplied, the next one's blocks are fetched.
    const int64_t next_rows = std::max<int64_t>(0, std::min(NR, N - n0 - NR));
    const float* next = reinterpret_cast<const float*>(w + (n0 + (next_rows ? NR : 0)) * row_bytes);
    panel::PanelOut out{y + n0, y + n0 + L, ldy, bias ? bias + n0 : nullptr,
                        bias ? bias + n0 + L : nullptr, rows, false};
    panel::multiply_panel(x, M, K, buf, next, next_rows * row_bytes / 4, 0, out);
  }
}

template <int64_t T>
void linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                 int64_t N, const float* bias, float* y, int64_t ldy, int64_t begin,
                 int64_t end) {
  if (M >= kWideRows) return linear_rows_panels<T>(x, M, K, w, row_bytes, N, bias, y, ldy, begin, end);
  // Both paths prefetch as they go, each weight row kPrefetchTiles tiles ahead.
  const int64_t ahead = kPrefetchTiles * kTile * row_bytes;
  for (int64_t n0 = begin; n0 < end; n0 += kTile) {
    const int64_t R = std::min(kTile, end - n0);
    const uint8_t* rows[kTile];  // a short tile repeats its first row (not stored)
    for (int r = 0; r < kTile; ++r) rows[r] = w + (r < R ? n0 + r : n0) * row_bytes;
    float sums[kWideRows - 1][kTile];
    switch (M) {
      case 1: one_row_tile<T>(x, K, rows, ahead, sums[0]); break;
      case 2: few_rows<T, 2>(x, K, rows, R, ahead, sums); break;
      case 3: few_rows<T, 3>(x, K, rows, R, ahead, sums); break;
      case 4: few_rows<T, 4>(x, K, rows, R, ahead, sums); break;
      case 5: few_rows<T, 5>(x, K, rows, R, ahead, sums); break;
      case 6: few_rows<T, 6>(x, K, rows, R, ahead, sums); break;
      case 7: few_rows<T, 7>(x, K, rows, R, ahead, sums); break;
      default: break;
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = 0; r < R; ++r) y[m * ldy + n0 + r] = sums[m][r] + (bias ? bias[n0 + r] : 0.f);
  }
}
#endif  // MINIVLLM_VEC

inline float dot(const float* a, const float* b, int64_t K) {
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) s += a[k] * b[k];
  return s;
}

// The portable path (and F32 / F16 rows): a row into floats, then dots.
void linear_rows_scalar(const float* x, int64_t M, int64_t K, int64_t t, const uint8_t* w,
                        int64_t row_bytes, const float* bias, float* y, int64_t ldy,
                        int64_t begin, int64_t end) {
  std::vector<float> row(K);
  for (int64_t n = begin; n < end; ++n) {
    dequantize_row_scalar(t, w + n * row_bytes, K, row.data());
    const float add = bias != nullptr ? bias[n] : 0.f;
    for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = dot(x + m * K, row.data(), K) + add;
  }
}

void dequantize_row(int64_t t, const uint8_t* row, int64_t K, float* out) {
#ifdef MINIVLLM_VEC
  switch (t) {
    case Q4_0: return dequantize_row_vec<Q4_0>(row, K, out);
    case Q4_1: return dequantize_row_vec<Q4_1>(row, K, out);
    case Q8_0: return dequantize_row_vec<Q8_0>(row, K, out);
    case Q4_K: return dequantize_row_vec<Q4_K>(row, K, out);
    case Q6_K: return dequantize_row_vec<Q6_K>(row, K, out);
    default: break;
  }
#endif
  dequantize_row_scalar(t, row, K, out);
}

void check_qweight(const at::Tensor& q, int64_t t, int64_t K, const char* op) {
  check_cpu(q, op, "qweight");
  const TypeInfo ti = type_info(t);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(), op,
              ": qweight must be contiguous uint8 [N, row_bytes], got ", q.scalar_type(), " ",
              q.sizes());
  TORCH_CHECK(K % ti.block == 0 && q.size(1) == K / ti.block * ti.bytes, op, ": ", K,
              " columns of type ", t, " take ", K / ti.block * ti.bytes, " bytes a row, got ",
              q.size(1));
}

}  // namespace

namespace slice {
void gguf_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                 int64_t qtype, int64_t N, const float* bias, float* y, int64_t ldy,
                 int64_t begin, int64_t end) {
  const int64_t unit = gguf_unit(M);
  begin *= unit;
  end = std::min(end * unit, N);
#ifdef MINIVLLM_VEC
  static_assert(gguf_tile % kTile == 0, "whole tiles a unit");
  switch (qtype) {
    case Q4_0: return linear_rows<Q4_0>(x, M, K, w, row_bytes, N, bias, y, ldy, begin, end);
    case Q4_1: return linear_rows<Q4_1>(x, M, K, w, row_bytes, N, bias, y, ldy, begin, end);
    case Q8_0: return linear_rows<Q8_0>(x, M, K, w, row_bytes, N, bias, y, ldy, begin, end);
    case Q4_K: return linear_rows<Q4_K>(x, M, K, w, row_bytes, N, bias, y, ldy, begin, end);
    case Q6_K: return linear_rows<Q6_K>(x, M, K, w, row_bytes, N, bias, y, ldy, begin, end);
    default: break;
  }
#endif
  linear_rows_scalar(x, M, K, qtype, w, row_bytes, bias, y, ldy, begin, end);
}
}  // namespace slice

int64_t gguf_row_bytes(int64_t qtype, int64_t cols) {
  switch (qtype) {
    case F32: case F16: case Q4_0: case Q4_1: case Q8_0: case Q4_K: case Q6_K: break;
    default: return -1;
  }
  const TypeInfo ti = type_info(qtype);
  return cols % ti.block == 0 ? cols / ti.block * ti.bytes : -1;
}

at::Tensor gguf_dequantize(at::Tensor qweight, int64_t qtype, int64_t cols) {
  check_qweight(qweight, qtype, cols, "gguf_dequantize");
  const int64_t N = qweight.size(0), row_bytes = qweight.size(1);
  auto out = at::empty({N, cols}, qweight.options().dtype(at::kFloat));
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequantize_row(qtype, w + n * row_bytes, cols, o + n * cols);
  });
  return out;
}

// y [M, N] = x [M, K] W^T (+ bias), W [N, K] as blocks of GGML type `qtype`.
// Up to gguf_max_rows rows: the kernels above on the blocks; more (prefill
// chunks, compute-bound): the matrix dequantized once and MKL's GEMM.
at::Tensor gguf_linear(at::Tensor x, at::Tensor qweight, int64_t qtype,
                       c10::optional<at::Tensor> bias) {
  check_cpu(x, "gguf_linear", "x");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "gguf_linear: x must be float32 "
              "[rows, K], got ", x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  check_qweight(qweight, qtype, K, "gguf_linear");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == N && b.scalar_type() == at::kFloat, "gguf_linear: bias must be "
                "float32 [", N, "]");
  }
  // A chunk of a prompt that samples no token asks the LM head for 0 rows.
  if (M == 0) return at::empty({0, N}, x.options());
  if (M > slice::gguf_max_rows) {
    c10::optional<at::Tensor> ob;
    if (b.defined()) ob = b;
    return at::linear(x, gguf_dequantize(qweight, qtype, K), ob);
  }
  x = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const int64_t unit = slice::gguf_unit(M), row_bytes = qweight.size(1);
  const int64_t units = (N + unit - 1) / unit;
  const float* xp = x.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t grain = M >= slice::gguf_wide_rows ? 1 : std::max<int64_t>(1, 4096 / K);
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    slice::gguf_linear(xp, M, K, w, row_bytes, qtype, N, bp, yp, N, begin, end);
  });
  return y;
}

int64_t gguf_max_rows() { return slice::gguf_max_rows; }

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("gguf_linear(Tensor x, Tensor qweight, int qtype, Tensor? bias) -> Tensor");
  m.def("gguf_dequantize(Tensor qweight, int qtype, int cols) -> Tensor");
  m.def("gguf_max_rows() -> int");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("gguf_linear", &minivllm::gguf_linear);
  m.impl("gguf_dequantize", &minivllm::gguf_dequantize);
}

TORCH_LIBRARY_IMPL(minivllm, CompositeExplicitAutograd, m) {
  m.impl("gguf_max_rows", &minivllm::gguf_max_rows);
}
