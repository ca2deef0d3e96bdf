// The online softmax's step over one span of scores, shared by the paged
// decode kernels (paged_attention.cpp, mla_decode.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu_types.h"

namespace minivllm {
namespace {

// Online-softmax step of one head over one block of n scores: s becomes
// their probabilities under the new running maximum m, l the new running
// sum; returns the factor the head's accumulator must be rescaled by.
inline float softmax_block(float* s, int64_t n, float& m, float& l) {
#ifdef MINIVLLM_VEC
  using vec::vf;
  constexpr int64_t L = vec::kLanes;
  // A vector of scores at a time: the scalar loops' max and sum were chains
  // of dependent instructions, a sizeable part of the kernel at short contexts.
  const vf lowest = vec::set1(-std::numeric_limits<float>::infinity());
  vf vmax = lowest;
  for (int64_t t = 0; t < n; t += L) vmax = vec::max(vmax, vec::load(s + t, vec::first(n - t), lowest));
  const float new_max = std::max(m, vec::reduce_max(vmax));
  vf vsum = vec::zero();
  for (int64_t t = 0; t < n; t += L) {
    const vec::mask k = vec::first(n - t);
    const vf p = vec::exp_nonpositive(vec::sub(vec::load(s + t, k, vec::zero()),
                                               vec::set1(new_max)));
    vec::store(s + t, p, k);
    vsum = vec::add(vsum, vec::keep(k, p));
  }
  const float sum = vec::reduce_add(vsum);
#else
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, s[t]);
  const float new_max = std::max(m, block_max);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_nonpositive(s[t] - new_max);
    sum += s[t];
  }
#endif
  const float correction = exp_nonpositive(m - new_max);
  l = l * correction + sum;
  m = new_max;
  return correction;
}

}  // namespace
}  // namespace minivllm
