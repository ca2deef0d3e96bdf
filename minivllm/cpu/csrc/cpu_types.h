// Shared helpers of the CPU kernels: dtype dispatch and float conversion.
//
// Every kernel computes in float32 whatever the tensor dtype (float32,
// bfloat16, float16), like the PyTorch reference paths they replace.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
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

#ifdef __AVX512F__
// exp_nonpositive on 16 lanes at once, the same steps written with intrinsics
// (for the loops the compiler does not vectorize by itself).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(0.69314718056f));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, k);  // p * 2^k
}
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

inline void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
}

}  // namespace minivllm
