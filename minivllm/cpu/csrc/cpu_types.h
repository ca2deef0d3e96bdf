// Shared helpers of the CPU kernels: dtype dispatch, float conversion and a
// small vector type (namespace vec) over the ISA the library is built for.
//
// Every kernel computes in float32 whatever the tensor dtype (float32,
// bfloat16, float16), like the PyTorch reference paths they replace.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
// The kernels' vector code paths exist (vec below); without them, portable
// loops only, and no panel GEMM.
#define MINIVLLM_VEC 1
#endif

#define MINIVLLM_DISPATCH_FLOATS(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

namespace minivllm {

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

// Rows per parallel task: enough elements that a thread's share outweighs
// the cost of waking it (a decode step has a few dozen rows of ~1k values).
inline int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems));
}

// exp(x) for x <= 0, written so the compiler can vectorize it (std::exp
// stays scalar): x = (k + f) ln 2 with k an integer and |f| <= 1/2, 2^k put
// straight into the exponent bits, e^(f ln 2) by its Taylor series to degree
// 7 (relative error below 1e-7 on that range).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // below that the result underflows anyway
  const float t = x * 1.44269504089f;
  const float k = std::nearbyint(t);
  const float y = (t - k) * 0.69314718056f;
  float p = 1.f / 5040.f;
  p = p * y + 1.f / 720.f;
  p = p * y + 1.f / 120.f;
  p = p * y + 1.f / 24.f;
  p = p * y + 1.f / 6.f;
  p = p * y + 0.5f;
  p = p * y + 1.f;
  p = p * y + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef MINIVLLM_VEC
// One float32 vector register and the handful of operations the kernels use,
// so each kernel is written once: 16 lanes of a zmm register with AVX-512,
// 8 lanes of a ymm register with AVX2 + FMA. The register files differ too
// (32 zmm, 16 ymm): kernels size their register tiles from kRegisters.
namespace vec {
#ifdef __AVX512F__
using vf = __m512;
using mask = __mmask16;  // one bit per lane
constexpr int kLanes = 16, kRegisters = 32;
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
// The first n lanes (n clamped to 0 .. kLanes).
inline mask first(int64_t n) {
  return n >= 16 ? mask(0xFFFF) : n <= 0 ? mask(0) : static_cast<mask>((1u << n) - 1);
}
// Masked load: lanes off in m read nothing and hold `fill`.
inline vf load(const float* p, mask m, vf fill) { return _mm512_mask_loadu_ps(fill, m, p); }
inline void store(float* p, vf v, mask m) { _mm512_mask_storeu_ps(p, m, v); }
inline vf keep(mask m, vf v) { return _mm512_maskz_mov_ps(m, v); }  // lanes off: 0
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline vf round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale2(vf p, vf k) { return _mm512_scalef_ps(p, k); }  // p * 2^k, k integral
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
// r[i] lane j <- r[j] lane i: 16 vectors transposed in registers (4 rounds of
// 16 shuffles: pairs of lanes, quads, then 128-bit quarters twice).
inline void transpose(vf* r) {
  vf t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  auto pd = [](vf a) { return _mm512_castps_pd(a); };
  for (int i = 0; i < 16; i += 4) {  // u[i + c], quarter q: rows i .. i + 3 of column 4q + c
    u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i]), pd(t[i + 2])));
    u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i]), pd(t[i + 2])));
    u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i + 1]), pd(t[i + 3])));
    u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i + 1]), pd(t[i + 3])));
  }
  for (int c = 0; c < 4; ++c) {
    const vf a02 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);  // quarters 0, 2 of each
    const vf a13 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd);  // quarters 1, 3
    const vf b02 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const vf b13 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_f32x4(a02, b02, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(a02, b02, 0xdd);
    r[4 + c] = _mm512_shuffle_f32x4(a13, b13, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(a13, b13, 0xdd);
  }
}
#else
using vf = __m256;
using mask = __m256i;  // a lane is on when its 32 bits are all ones
constexpr int kLanes = 8, kRegisters = 16;
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline mask first(int64_t n) {
  const int32_t c = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(n, 0), 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf load(const float* p, mask m, vf fill) {
  return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
inline void store(float* p, vf v, mask m) { _mm256_maskstore_ps(p, m, v); }
inline vf keep(mask m, vf v) { return _mm256_and_ps(v, _mm256_castsi256_ps(m)); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// AVX2 has no scalef: 2^k built in the exponent bits (k >= -126 here), as
// the scalar exp_nonpositive does.
inline vf scale2(vf p, vf k) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
inline float reduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// r[i] lane j <- r[j] lane i: 8 vectors transposed in registers.
inline void transpose(vf* r) {
  vf t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // u[i + c], half h: rows i .. i + 3 of column 4h + c
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}
#endif

// kLanes 16-bit floats as a float32 vector, converted in registers (both
// exactly: a bfloat16 is the top half of a float32; a float16 through F16C's
// IEEE conversion), so a kernel reads a bfloat16 or float16 tensor as it
// reads a float32 one, without a float32 copy in memory.
#ifdef __AVX512F__
using half_bits = __m256i;  // kLanes 16-bit values
inline half_bits load_bits(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline vf bf16_to_float(half_bits b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline vf load(const c10::Half* p) { return _mm512_cvtph_ps(load_bits(p)); }
#else
using half_bits = __m128i;
inline half_bits load_bits(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline vf bf16_to_float(half_bits b) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
inline vf load(const c10::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(load_bits(p));
#else
  alignas(32) float f[kLanes];
  for (int i = 0; i < kLanes; ++i) f[i] = static_cast<float>(p[i]);
  return load(f);
#endif
}
#endif
inline vf load(const c10::BFloat16* p) { return bf16_to_float(load_bits(p)); }

// exp_nonpositive on every lane at once, the same steps as the scalar one
// (for the loops the compiler does not vectorize by itself).
inline vf exp_nonpositive(vf x) {
  x = max(x, set1(-87.f));
  const vf t = mul(x, set1(1.44269504089f));
  const vf k = round(t);
  const vf y = mul(sub(t, k), set1(0.69314718056f));
  vf p = set1(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = fmadd(p, y, set1(c));
  return scale2(p, k);
}
}  // namespace vec
#endif

// One row of SwiGLU's gate: out = silu(gate) * up, d values. Shared by the
// silu_and_mul kernel and the panel GEMM's fused epilogue (gemm.cpp), so the
// two give the same bits.
template <typename T>
inline void silu_and_mul_row(const T* gate, const T* up, T* out, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float g = to_float(gate[i]);
    // sigmoid(g) from e = exp(-|g|) <= 1 (the vectorizable exp; no overflow).
    const float e = exp_nonpositive(-std::abs(g));
    // One division, the numerator chosen (a select of two divisions compiles to both).
    const float sigmoid = (g >= 0.f ? 1.f : e) / (1.f + e);
    // silu rounded to the dtype first, as F.silu(gate) * up does.
    const T s = from_float<T>(g * sigmoid);
    out[i] = from_float<T>(to_float(s) * to_float(up[i]));
  }
}

#ifdef MINIVLLM_VEC
// The one-row products' software prefetch of the weight stream (gguf_gemm.cpp,
// gguf_int8.cpp). On AMD a non-temporal prefetch keeps the step's ~100 MB from
// evicting what the Python step between two decode steps works on. On Intel the
// same hint fills L1 alone, bypassing L2, so a line pushed out of L1 before its
// use is read from memory again and the stream slows: there the ordinary hint
// is the faster one (`python -m minivllm.lab.bench.gguf_gemv` measures both
// sides of it on the machine at hand: the streamed and cache-hot rates).
inline bool intel_cpu() {
  __builtin_cpu_init();  // needed when this runs during static initialization
  return __builtin_cpu_is("intel");
}
inline const bool kTemporalStreamPrefetch = intel_cpu();
inline void prefetch_stream(const void* p) {
  if (kTemporalStreamPrefetch) {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
  } else {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
  }
}
#endif

inline void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
}

}  // namespace minivllm
