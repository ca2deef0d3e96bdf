// The GGML block types the GGUF kernels read (gguf_gemm.cpp, gguf_int8.cpp),
// and how a block becomes floats: the C++ twin of
// minivllm/model/layers/quantization/ggml_types.py (its layouts, its
// arithmetic in its order, so the same bits), one block at a time (the
// portable path) and a group of 32 weights in vector registers.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "cpu_types.h"

// No fused multiply-add: the reference rounds a product before it adds.
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

namespace minivllm {
namespace gguf {

enum GgmlType : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

struct TypeInfo {
  int64_t block, bytes;  // weights and bytes per block
};

[[noreturn]] inline void unsupported_type(int64_t t) {
  TORCH_CHECK(false, "gguf: unsupported GGML type ", t);
  __builtin_unreachable();
}

// (constexpr, so the kernels' templates take their block sizes from here too)
constexpr TypeInfo type_info(int64_t t) {
  switch (t) {
    case F32: return {1, 4};
    case F16: return {1, 2};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
    default: unsupported_type(t);
  }
}

// Bytes of one block.
constexpr int64_t block_bytes(int64_t t) { return type_info(t).bytes; }

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

NO_CONTRACT inline void q4_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>((b[2 + i] & 0x0F) - 8);
    out[i + 16] = d * static_cast<float>((b[2 + i] >> 4) - 8);
  }
}

NO_CONTRACT inline void q4_1(const uint8_t* b, float* out) {
  const float d = f16(b), m = f16(b + 2);
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>(b[4 + i] & 0x0F) + m;
    out[i + 16] = d * static_cast<float>(b[4 + i] >> 4) + m;
  }
}

NO_CONTRACT inline void q8_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q[i]) * d;
}

NO_CONTRACT inline void q4_k(const uint8_t* b, float* out) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* s = b + 4;
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {  // sub-block j: 6-bit scale and min (ggml_types._k_scales_mins)
    const int sc = j < 4 ? s[j] & 0x3F : (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    const int mn = j < 4 ? s[j + 4] & 0x3F : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    const float scale = d * static_cast<float>(sc), shift = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shiftbits = 4 * (j % 2);
    for (int i = 0; i < 32; ++i)
      out[32 * j + i] = scale * static_cast<float>((q[i] >> shiftbits) & 0x0F) - shift;
  }
}

NO_CONTRACT inline void q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int h = 0; h < 2; ++h)  // two halves of 128 weights
    for (int g = 0; g < 4; ++g)  // groups of 32: low or high nibbles of 32 ql bytes
      for (int i = 0; i < 32; ++i) {
        const int idx = 128 * h + 32 * g + i;
        const int lo = (ql[64 * h + 32 * (g % 2) + i] >> (4 * (g / 2))) & 0x0F;
        const int hi = (qh[32 * h + i] >> (2 * g)) & 0x03;
        const float scale = d * static_cast<float>(sc[idx / 16]);
        out[idx] = scale * static_cast<float>((lo | (hi << 4)) - 32);
      }
}

// One row of K weights into floats (the portable path's, and the K-quants').
inline void dequantize_row_scalar(int64_t t, const uint8_t* row, int64_t K, float* out) {
  switch (t) {
    case F32: std::memcpy(out, row, K * 4); return;
    case F16:
      for (int64_t i = 0; i < K; ++i) out[i] = f16(row + 2 * i);
      return;
    default: break;
  }
  const TypeInfo ti = type_info(t);
  void (*block)(const uint8_t*, float*) =
      t == Q4_0 ? q4_0 : t == Q4_1 ? q4_1 : t == Q8_0 ? q8_0 : t == Q4_K ? q4_k : q6_k;
  for (int64_t k = 0, i = 0; k < K; k += ti.block, ++i) block(row + i * ti.bytes, out + k);
}

#ifdef MINIVLLM_VEC
// ---------------------------------------------------------------------------
// The vector kernels. A row is read 32 weights (a "group") at a time: a whole
// block of the 32-weight types, a sub-block of the K-quants. A group becomes
// G float vectors in registers: the packed integers are widened to int32
// lanes, masked and shifted, converted to float and scaled with the block's
// numbers, in the reference's order and rounding (a product is rounded before
// a minimum is added: `rounded` keeps the compiler from fusing the two into
// one FMA, which would round once and give other weights).
// ---------------------------------------------------------------------------
using vec::vf;
constexpr int64_t L = vec::kLanes;
constexpr int G = static_cast<int>(32 / L);  // vectors per group

#ifdef __AVX512F__
using vi = __m512i;
inline vi u8(const uint8_t* p) {  // L bytes, zero-extended
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vi s8(const uint8_t* p) {  // L bytes, sign-extended
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vi shr(vi a, int s) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(s)); }
inline vi shl(vi a, int s) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(s)); }
inline vi band(vi a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
inline vi bor(vi a, vi b) { return _mm512_or_si512(a, b); }
inline vi subi(vi a, int b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline vf to_f(vi a) { return _mm512_cvtepi32_ps(a); }
#else
using vi = __m256i;
inline vi u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vi s8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vi shr(vi a, int s) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(s)); }
inline vi shl(vi a, int s) { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(s)); }
inline vi band(vi a, int m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
inline vi bor(vi a, vi b) { return _mm256_or_si256(a, b); }
inline vi subi(vi a, int b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
inline vf to_f(vi a) { return _mm256_cvtepi32_ps(a); }
#endif

// A product as its own rounded result (an empty asm the compiler cannot see through).
inline vf rounded(vf v) {
  asm("" : "+x"(v));
  return v;
}

// 4-bit weights c*L .. c*L+L of a 16-byte run: byte k holds weight k (low
// nibble) and k + 16 (high). (The bytes are zero-extended: a high nibble
// needs the shift only, a low one the mask only.)
inline vi nibbles(const uint8_t* qs, int c) {
  const vi q = u8(qs + (c * L) % 16);
  return c * L >= 16 ? shr(q, 4) : band(q, 0x0F);
}

// Each format: weights and bytes per block, groups per block, and group g of
// block b into out[0..G).
template <int64_t T> struct Fmt;

template <> struct Fmt<Q4_0> {
  static constexpr int64_t block = 32, bytes = 18, groups = 1;
  static inline void group(const uint8_t* b, int, vf* out) {
    const vf d = vec::set1(f16(b));
    for (int c = 0; c < G; ++c) out[c] = vec::mul(d, to_f(subi(nibbles(b + 2, c), 8)));
  }
};

template <> struct Fmt<Q4_1> {
  static constexpr int64_t block = 32, bytes = 20, groups = 1;
  static inline void group(const uint8_t* b, int, vf* out) {
    const vf d = vec::set1(f16(b)), m = vec::set1(f16(b + 2));
    for (int c = 0; c < G; ++c) out[c] = vec::add(rounded(vec::mul(d, to_f(nibbles(b + 4, c)))), m);
  }
};

template <> struct Fmt<Q8_0> {
  static constexpr int64_t block = 32, bytes = 34, groups = 1;
  static inline void group(const uint8_t* b, int, vf* out) {
    const vf d = vec::set1(f16(b));
    for (int c = 0; c < G; ++c) out[c] = vec::mul(to_f(s8(b + 2 + c * L)), d);
  }
};

template <> struct Fmt<Q4_K> {
  static constexpr int64_t block = 256, bytes = 144, groups = 8;
  static inline void group(const uint8_t* b, int j, vf* out) {
    const uint8_t* s = b + 4;  // sub-block j's 6-bit scale and min, as q4_k above
    const int sc = j < 4 ? s[j] & 0x3F : (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    const int mn = j < 4 ? s[j + 4] & 0x3F : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    const vf scale = vec::set1(f16(b) * static_cast<float>(sc));
    const vf shift = vec::set1(f16(b + 2) * static_cast<float>(mn));
    const uint8_t* q = b + 16 + 32 * (j / 2);
    for (int c = 0; c < G; ++c)
      out[c] = vec::sub(rounded(vec::mul(scale, to_f(band(shr(u8(q + c * L), 4 * (j % 2)), 0x0F)))),
                        shift);
  }
};

template <> struct Fmt<Q6_K> {
  static constexpr int64_t block = 256, bytes = 210, groups = 8;
  static inline void group(const uint8_t* b, int j, vf* out) {
    const int h = j / 4, g = j % 4;  // half of 128, group of 32 in it (q6_k above)
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int c = 0; c < G; ++c) {
      const int i = static_cast<int>(c * L);
      const vi lo = band(shr(u8(b + 64 * h + 32 * (g % 2) + i), 4 * (g / 2)), 0x0F);
      const vi hi = band(shr(u8(b + 128 + 32 * h + i), 2 * g), 0x03);
      const vf scale = vec::set1(d * static_cast<float>(sc[(128 * h + 32 * g + i) / 16]));
      out[c] = vec::mul(scale, to_f(subi(bor(lo, shl(hi, 4)), 32)));
    }
  }
};

template <int64_t T>
inline void dequantize_row_vec(const uint8_t* row, int64_t K, float* out) {
  using F = Fmt<T>;
  vf w[G];
  for (int64_t k = 0; k < K; k += 32) {
    F::group(row + (k / F::block) * F::bytes, static_cast<int>((k % F::block) / 32), w);
    for (int c = 0; c < G; ++c) vec::store(out + k + c * L, w[c]);
  }
}
#endif  // MINIVLLM_VEC

}  // namespace gguf
}  // namespace minivllm
