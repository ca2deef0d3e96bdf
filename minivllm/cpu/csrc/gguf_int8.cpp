// Products on GGUF blocks with int8 activations (activation_dtype="int8"):
// the numbers of minivllm/model/layers/quantization/int8_activations.py, bit
// for bit, for Q4_0, Q4_1 and Q8_0 weights.
//
// Why: the float-activation kernel (gguf_gemm.cpp) turns every weight into a
// float before its multiply-add, and on two cores that arithmetic, not the
// memory, bounds a one-row product. Here x is quantized once per call to int8
// blocks of 32 (its scale as float16, as llama.cpp's Q8_0 / Q8_1), and
// AVX512-VNNI's vpdpbusd multiplies 64 unsigned weight bytes by 64 signed x
// bytes and adds them in fours into 16 int32 lanes: one instruction for two
// blocks. The weights are used as unsigned bytes: a Q4 nibble as it is, a Q8_0
// byte plus 128; the offsets (8 for Q4_0, 128 for Q8_0) times the x block's
// integer sum are subtracted after, exactly.
//
// Exactness: the integer sums are exact however they are added, so only the
// float steps must follow the reference: per block sumi * (d_w * d_x) (+ m_w *
// s_x, rounded apart, no FMA), each block into lane b % 16 of one float
// accumulator, in block order, then the lanes pairwise 8 + 8, 4 + 4, 2 + 2, 1
// + 1. To get 16 blocks' sums into the 16 lanes in block order, a chunk's 8
// vpdpbusd results (two blocks each) are added in a transposing tree (three
// levels of unpack / shuffle + add), with the blocks paired (i, i + 4) so that
// the tree's output comes out in order.
//
// Without AVX512-VNNI in the build, a portable loop computes the same numbers.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <vector>

#include "cpu_types.h"
#include "gguf_blocks.h"
#include "ops.h"

namespace minivllm {
namespace {

using namespace gguf;
constexpr int64_t kLanes = 16;  // blocks per chunk: the float accumulator's lanes
constexpr int64_t kTile = 4;    // weight rows streamed together (as gguf_gemm.cpp)
constexpr int64_t kPrefetchTiles = 4;  // how far ahead each row prefetches (gguf_gemm.cpp's)
constexpr int64_t kTailBlocks = 4;  // a last chunk this short goes block by block

inline float round_f16(float v) { return static_cast<float>(c10::Half(v)); }

// Where the 32 x bytes of chunk-local block b go in the kernel's layout: a
// chunk is 8 pairs of 64 bytes, pair i holding blocks a = i (i < 4) or i + 4,
// and a + 4. The Q4 types' weights come as [a low nibbles, b low, a high, b
// high] (16 bytes each), so x's halves are interleaved the same way; Q8_0's
// as [a, b].
struct Place {
  int64_t pair, second;  // pair index in the chunk; 0: the pair's a, 1: its b
};
inline Place place(int64_t b) {
  const int64_t i = b % 4 + (b >= 8 ? 4 : 0);
  return {i, (b / 4) % 2};
}

}  // namespace

namespace slice {
// x rows quantized for one weight type: per row, chunks of kLanes blocks
// (zero past the last block): qs in the kernel's layout, q as plain blocks
// (the portable path), and per block the integer sum, d and s.
void Int8Rows::quantize(const float* x, int64_t M, int64_t K, int64_t qtype) {
  rows = M;
  blocks = K / 32;
  chunks = (blocks + kLanes - 1) / kLanes;
  type = qtype;
  const int64_t nbp = chunks * kLanes;
  qs.assign(M * nbp * 32, 0);
  q.assign(M * nbp * 32, 0);
  sums.assign(M * nbp, 0);
  d.assign(M * nbp, 0.f);
  s.assign(M * nbp, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) quantize_block(x + m * K + b * 32, m * nbp + b);
}

NO_CONTRACT void Int8Rows::quantize_block(const float* x, int64_t at) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax == 0.f ? 0.f : 127.f / amax, dx = amax / 127.f;
  int8_t* out = q.data() + at * 32;
  int32_t sum = 0;
  for (int i = 0; i < 32; ++i) {
    out[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));  // halves to even
    sum += out[i];
  }
  sums[at] = sum;
  d[at] = round_f16(dx);
  s[at] = round_f16(static_cast<float>(sum) * dx);
  // The kernel's layout of this block (row base + chunk + pair, see place()).
  const int64_t nbp = chunks * kLanes, row = at / nbp, b = at % nbp, c = b / kLanes;
  const Place p = place(b % kLanes);
  int8_t* pair = qs.data() + (row * nbp + c * kLanes) * 32 + p.pair * 64;
  if (type == Q8_0) {
    std::memcpy(pair + 32 * p.second, out, 32);
  } else {
    std::memcpy(pair + 16 * p.second, out, 16);
    std::memcpy(pair + 32 + 16 * p.second, out + 16, 16);
  }
}
}  // namespace slice

namespace {

// A block's value: sumi * (d_w * d_x), plus (Q4_1) m_w * s_x rounded apart.
NO_CONTRACT inline float block_value(float sumi, float dd, float ms, bool with_min) {
  const float v = sumi * dd;
  return with_min ? v + ms : v;
}

// The portable path: the reference's order, a block at a time.
NO_CONTRACT float row_dot_scalar(const slice::Int8Rows& xq, int64_t m, const uint8_t* w,
                                 int64_t qtype) {
  const int64_t nbp = xq.chunks * kLanes, bytes = block_bytes(qtype);
  float acc[kLanes] = {};
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* blk = w + b * bytes;
    const int8_t* x = xq.q.data() + (m * nbp + b) * 32;
    int32_t sumi = 0;
    for (int i = 0; i < 32; ++i) {
      int wi;
      if (qtype == Q8_0) wi = static_cast<int8_t>(blk[2 + i]);
      else {
        const uint8_t byte = blk[(qtype == Q4_1 ? 4 : 2) + i % 16];
        wi = (i < 16 ? byte & 0x0F : byte >> 4) - (qtype == Q4_0 ? 8 : 0);
      }
      sumi += wi * x[i];
    }
    const float dd = f16(blk) * xq.d[m * nbp + b];
    float v = static_cast<float>(sumi) * dd;
    if (qtype == Q4_1) {
      const float ms = f16(blk + 2) * xq.s[m * nbp + b];
      v = v + ms;
    }
    acc[b % kLanes] = acc[b % kLanes] + v;
  }
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t j = 0; j < width; ++j) acc[j] = acc[j] + acc[j + width];
  return acc[0];
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
#define MINIVLLM_INT8_VNNI 1

// A product kept apart from the add that follows (no FMA: the reference rounds
// twice); the 16-lane one is gguf_blocks.h's.
using gguf::rounded;
inline __m128 rounded(__m128 v) {
  asm("" : "+v"(v));
  return v;
}

// The 64 weight bytes of pair (a, b) as unsigned bytes in the layout above;
// `has_b` false: b is past the row's end (zeros).
template <int64_t T>
inline __m512i weight_pair(const uint8_t* a, const uint8_t* b, bool has_b) {
  // Broadcast loads and blends, no shuffles: the shuffle ports are the tree's.
  if constexpr (T == Q8_0) {
    __m512i w = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2)));
    w = has_b ? _mm512_mask_broadcast_i64x4(
                    w, 0xF0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)))
              : _mm512_mask_set1_epi8(w, ~0xFFFFFFFFull, static_cast<char>(0x80));
    return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));  // q + 128
  } else {
    constexpr int off = T == Q4_1 ? 4 : 2;
    __m512i w = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + off)));
    w = has_b ? _mm512_mask_broadcast_i32x4(
                    w, 0xF0F0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off)))
              : _mm512_maskz_mov_epi32(0x0F0F, w);
    w = _mm512_mask_srli_epi16(w, 0xFFFF0000u, w, 4);  // lanes 2-3: the high nibbles
    return _mm512_and_si512(w, _mm512_set1_epi8(0x0F));
  }
}

// 8 vectors of 16 int32 partial sums (pair i: block a's in two 128-bit
// lanes, b's in the other two) -> one vector of the 16 blocks' sums in block
// order. Levels 1-2 sum each 128-bit lane of each input into one int32
// (transposing as they go); level 3 adds a block's two lanes.
template <int64_t T>
inline __m512i block_sums(const __m512i* z) {
  __m512i t[4], u[2];
  for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]),
                            _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                            _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
  if constexpr (T == Q8_0)  // lanes a, a, b, b
    return _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  else  // lanes a, b, a, b
    return _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
}

// The 16 blocks' scales from a chunk's bytes (count blocks, the rest zero):
// Q4_1, dword 5 b (d | m << 16) in lane b; Q4_0 / Q8_0, word 9 b / 17 b (d)
// in 16-bit lane b. Not a gather (the one-row product's slowest instruction
// on a Zen 5): windows of 128 bytes, two masked loads (never past the chunk)
// and one two-table permute each.
// Per type, the windows' permute indices and lanes (for a whole chunk; a
// short one masks its lanes and loads).
template <int64_t T> struct HeadWindows {
  static constexpr int64_t bytes = block_bytes(T);
  static constexpr int64_t esize = T == Q4_1 ? 4 : 2, per_window = 128 / esize;
  static constexpr int64_t count = (kLanes * bytes + 127) / 128;
  alignas(64) uint16_t idx[count][32] = {};
  uint32_t lanes[count] = {};
  constexpr HeadWindows() {
    for (int64_t b = 0; b < kLanes; ++b) {
      const int64_t e = b * bytes / esize;  // element of block b's head
      idx[e / per_window][b] = static_cast<uint16_t>(e % per_window);
      lanes[e / per_window] |= 1u << b;
    }
  }
};

template <int64_t T>
inline __m512i block_heads(const uint8_t* base, int64_t count) {
  using H = HeadWindows<T>;
  static constexpr H h{};
  const int64_t end = count * H::bytes;
  const uint32_t live = count >= kLanes ? 0xFFFF : (1u << count) - 1;
  __m512i out = _mm512_setzero_si512();
  auto load = [&](int64_t at) {  // 64 bytes from `at`, those past `end` zero
    if (at + 64 <= end) return _mm512_loadu_si512(base + at);
    const int64_t n = std::max<int64_t>(0, end - at);
    return _mm512_maskz_loadu_epi8(n >= 64 ? ~0ull : (1ull << n) - 1, base + at);
  };
  for (int64_t j = 0; j < H::count && j * 128 < end; ++j) {
    const __m512i lo = load(j * 128), hi = load(j * 128 + 64);
    if constexpr (T == Q4_1) {
      const __m512i ix = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(h.idx[j])));
      out = _mm512_mask_mov_epi32(out, static_cast<__mmask16>(h.lanes[j] & live),
                                  _mm512_permutex2var_epi32(lo, ix, hi));
    } else {
      out = _mm512_mask_mov_epi16(out, h.lanes[j] & live,
                                  _mm512_permutex2var_epi16(lo, _mm512_load_si512(h.idx[j]), hi));
    }
  }
  return out;
}

// One chunk (up to 16 blocks from `blk`, `count` of them) of one weight row
// against x row m's chunk c: the 16 blocks' values, lanes past count zero.
template <int64_t T>
inline __m512 chunk_values(const uint8_t* row, int64_t blk0, int64_t count,
                           const slice::Int8Rows& xq, int64_t at) {
  constexpr int64_t bytes = block_bytes(T);
  const __m512i* xs = reinterpret_cast<const __m512i*>(xq.qs.data() + at * 32);
  const uint8_t* base = row + blk0 * bytes;
  __m512i z[8];
  for (int i = 0; i < 8; ++i) {
    const int64_t a = i < 4 ? i : i + 4;
    if (a >= count) {
      z[i] = _mm512_setzero_si512();
      continue;
    }
    const __m512i w = weight_pair<T>(base + a * bytes, base + (a + 4) * bytes, a + 4 < count);
    z[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xs + i));
  }
  __m512i sumi = block_sums<T>(z);
  if constexpr (T != Q4_1) {  // the unsigned offset back out: 8 (Q4_0) or 128 (Q8_0) x sum
    const __m512i xsum = _mm512_loadu_si512(xq.sums.data() + at);
    sumi = _mm512_sub_epi32(sumi, _mm512_slli_epi32(xsum, T == Q4_0 ? 3 : 7));
  }
  const __m512i head = block_heads<T>(base, count);
  const __m512 dw = T == Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head))
                              : _mm512_cvtph_ps(_mm512_castsi512_si256(head));
  const __m512 dd = rounded(_mm512_mul_ps(dw, _mm512_loadu_ps(xq.d.data() + at)));
  __m512 v = rounded(_mm512_mul_ps(_mm512_cvtepi32_ps(sumi), dd));
  if constexpr (T == Q4_1) {
    const __m512 mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
    v = _mm512_add_ps(v, rounded(_mm512_mul_ps(mw, _mm512_loadu_ps(xq.s.data() + at))));
  }
  return v;
}

// A short last chunk (K = 576: 18 blocks, a chunk of 2) block by block, each
// block's value added into its lane alone. The same numbers as chunk_values:
// a lane that chunk_values would add 0.0 to cannot be -0.0 (it starts at +0.0
// and round-to-nearest never makes -0.0 of a sum that is not -0.0 + -0.0), so
// adding nothing leaves it as adding 0.0 would.
template <int64_t T>
inline __m512 tail_blocks(__m512 acc, const uint8_t* row, int64_t blk0, int64_t count,
                          const slice::Int8Rows& xq, int64_t at) {
  constexpr int64_t bytes = block_bytes(T);
  for (int64_t j = 0; j < count; ++j) {
    const uint8_t* b = row + (blk0 + j) * bytes;
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + (at + j) * 32));
    __m256i w;
    if constexpr (T == Q8_0) {
      w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)),
                           _mm256_set1_epi8(static_cast<char>(0x80)));
    } else {
      w = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (T == Q4_1 ? 4 : 2))));
      w = _mm256_and_si256(_mm256_mask_srli_epi16(w, 0xFF00, w, 4), _mm256_set1_epi8(0x0F));
    }
    const __m256i z = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(z), _mm256_extracti128_si256(z, 1));
    h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    int32_t sumi = _mm_cvtsi128_si32(h) + _mm_extract_epi32(h, 1);
    if constexpr (T != Q4_1) sumi -= xq.sums[at + j] * (T == Q4_0 ? 8 : 128);
    const __m128 head = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(b)));
    const __m128 dd = rounded(_mm_mul_ss(head, _mm_set_ss(xq.d[at + j])));
    __m128 v = rounded(_mm_mul_ss(_mm_cvtsi32_ss(_mm_setzero_ps(), sumi), dd));
    if constexpr (T == Q4_1)
      v = _mm_add_ss(v, rounded(_mm_mul_ss(_mm_movehdup_ps(head), _mm_set_ss(xq.s[at + j]))));
    acc = _mm512_mask_add_ps(acc, static_cast<__mmask16>(1u << j), acc,
                             _mm512_broadcastss_ps(v));
  }
  return acc;
}

// The 16 lanes pairwise: 8 + 8, 4 + 4, 2 + 2, 1 + 1.
inline float lanes_sum(__m512 acc) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}

// kTile weight rows against x row m: sums[r] for each.
template <int64_t T>
void tile_rows(const slice::Int8Rows& xq, int64_t m, const uint8_t* const* w, int64_t ahead,
               float* sums) {
  constexpr int64_t bytes = block_bytes(T);
  const int64_t nbp = xq.chunks * kLanes;
  __m512 acc[kTile];
  for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < xq.chunks; ++c) {
    const int64_t blk0 = c * kLanes, count = std::min(kLanes, xq.blocks - blk0);
    if (ahead > 0)  // each row's next lines (as gguf_gemm.cpp's one-row product)
      for (int r = 0; r < kTile; ++r)
        for (int64_t o = 0; o < count * bytes; o += 64) prefetch_stream(w[r] + blk0 * bytes + o + ahead);
    if (count <= kTailBlocks) {
      for (int r = 0; r < kTile; ++r)
        acc[r] = tail_blocks<T>(acc[r], w[r], blk0, count, xq, m * nbp + blk0);
      continue;
    }
    for (int r = 0; r < kTile; ++r)
      acc[r] = _mm512_add_ps(acc[r], chunk_values<T>(w[r], blk0, count, xq, m * nbp + blk0));
  }
  for (int r = 0; r < kTile; ++r) sums[r] = lanes_sum(acc[r]);
}
#endif  // VNNI

template <int64_t T>
void linear_rows(const slice::Int8Rows& xq, const uint8_t* w, int64_t row_bytes,
                 const float* bias, float* y, int64_t ldy, int64_t begin, int64_t end) {
  for (int64_t n0 = begin; n0 < end; n0 += kTile) {
    const int64_t R = std::min(kTile, end - n0);
    const uint8_t* rows[kTile];  // a short tile repeats its first row (not stored)
    for (int r = 0; r < kTile; ++r) rows[r] = w + (r < R ? n0 + r : n0) * row_bytes;
    for (int64_t m = 0; m < xq.rows; ++m) {
      float sums[kTile];
#ifdef MINIVLLM_INT8_VNNI
      // (Only the first x row streams the weights; the others find them in L1.)
      tile_rows<T>(xq, m, rows, m == 0 ? kPrefetchTiles * kTile * row_bytes : 0, sums);
#else
      for (int r = 0; r < kTile; ++r) sums[r] = row_dot_scalar(xq, m, rows[r], T);
#endif
      for (int64_t r = 0; r < R; ++r)
        y[m * ldy + n0 + r] = sums[r] + (bias ? bias[n0 + r] : 0.f);
    }
  }
}

}  // namespace

namespace slice {
bool gguf_int8_type(int64_t qtype) { return qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0; }

void gguf_linear_int8(const Int8Rows& xq, const uint8_t* w, int64_t row_bytes, int64_t N,
                      const float* bias, float* y, int64_t ldy, int64_t begin, int64_t end) {
  begin *= gguf_tile;
  end = std::min(end * gguf_tile, N);
  switch (xq.type) {
    case Q4_0: return linear_rows<Q4_0>(xq, w, row_bytes, bias, y, ldy, begin, end);
    case Q4_1: return linear_rows<Q4_1>(xq, w, row_bytes, bias, y, ldy, begin, end);
    case Q8_0: return linear_rows<Q8_0>(xq, w, row_bytes, bias, y, ldy, begin, end);
    default: TORCH_CHECK(false, "gguf_linear_int8: GGML type ", xq.type, " has no int8 product");
  }
}
}  // namespace slice

bool gguf_int8_vnni() {
#ifdef MINIVLLM_INT8_VNNI
  return true;
#else
  return false;
#endif
}

// y [M, N] = x [M, K] W^T (+ bias) with x quantized to int8 blocks (once, here).
at::Tensor gguf_linear_int8(at::Tensor x, at::Tensor qweight, int64_t qtype,
                            c10::optional<at::Tensor> bias) {
  TORCH_CHECK(slice::gguf_int8_type(qtype), "gguf_linear_int8: qtype ", qtype,
              " has no int8 product (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 have)");
  check_cpu(x, "gguf_linear_int8", "x");
  check_cpu(qweight, "gguf_linear_int8", "qweight");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "gguf_linear_int8: x must be "
              "float32 [rows, K], got ", x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte &&
                  qweight.is_contiguous() && K % 32 == 0 &&
                  qweight.size(1) == K / 32 * block_bytes(qtype),
              "gguf_linear_int8: qweight must be contiguous uint8 [N, ", K / 32 * block_bytes(qtype),
              "] for ", K, " columns of type ", qtype, ", got ", qweight.sizes());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == N && b.scalar_type() == at::kFloat, "gguf_linear_int8: bias must "
                "be float32 [", N, "]");
  }
  if (M == 0) return at::empty({0, N}, x.options());  // a prompt chunk that samples nothing
  x = x.contiguous();
  slice::Int8Rows xq;
  xq.quantize(x.data_ptr<float>(), M, K, qtype);
  auto y = at::empty({M, N}, x.options());
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t units = (N + slice::gguf_tile - 1) / slice::gguf_tile;
  at::parallel_for(0, units, std::max<int64_t>(1, 4096 / K), [&](int64_t begin, int64_t end) {
    slice::gguf_linear_int8(xq, w, qweight.size(1), N, bp, yp, N, begin, end);
  });
  return y;
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("gguf_linear_int8(Tensor x, Tensor qweight, int qtype, Tensor? bias) -> Tensor");
  m.def("gguf_int8_vnni() -> bool");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) { m.impl("gguf_linear_int8", &minivllm::gguf_linear_int8); }

TORCH_LIBRARY_IMPL(minivllm, CompositeExplicitAutograd, m) {
  m.impl("gguf_int8_vnni", &minivllm::gguf_int8_vnni);
}
