// Paged decode attention for CPUs: one new query token per sequence, its keys
// and values read in place through the block table (never gathered into a
// padded copy, which is what the pure-PyTorch path has to do).
//
//   out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b,   K_b, V_b = the first
//   seq_lens[b] tokens of sequence b, token p in block block_tables[b][p / bs]
//
// One work item per sequence: the G = H / Hkv query heads that share a KV head
// are handled together, so each key and value row is loaded once for all of
// them (grouped-query attention). Keys are visited block by block
// with the online softmax: a running maximum m, a running sum l and an
// accumulator rescaled whenever m grows, so one pass over the context suffices.
// Everything accumulates in float32, whatever the cache dtype.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_types.h"
#include "ops.h"

namespace minivllm {
namespace {

// Row r of a cache block as float32: the row itself for float32 caches,
// else converted into `buf`.
template <typename T>
inline const float* as_float(const T* row, float* buf, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) buf[i] = to_float(row[i]);
    return buf;
  }
}

inline float dot(const float* a, const float* b, int64_t d) {
#ifdef __AVX512F__
  // The compiler's own reduction ends in a chain of 15 scalar adds; on a
  // 64-wide head that chain, not the multiplies, would set the pace.
  if (d % 16 == 0) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t i = 16; i < d; i += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += p * x[i];
}

// One cache slot (all KV heads of a token) into L2.
template <typename T>
inline void prefetch_slot(const T* slot, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(slot);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64)
    _mm_prefetch(p + off, _MM_HINT_T1);
}

// Online-softmax update of one head for one block of n scores (overwritten
// with their probabilities under the new running maximum).
inline void softmax_update(float* s, int64_t n, float& m, float& l, float* acc, int64_t d) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, s[t]);
  const float new_max = std::max(m, block_max);
  const float correction = exp_nonpositive(m - new_max);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_nonpositive(s[t] - new_max);
    sum += s[t];
  }
  l = l * correction + sum;
  m = new_max;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] *= correction;
}

// kD > 0: the head size as a compile-time constant, so the short per-token
// loops (dot products, updates) are fully unrolled; 0: any size at run time.
// Sequences [begin, end). One work item per sequence: a block's slots are
// then read front to back, all KV heads of a slot together.
template <typename T, int kD>
void attend_seqs(const T* q, int64_t ldq, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                 const int32_t* seq_lens, T* out, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, int64_t block_size, int64_t table_width, float scale,
                 int64_t begin, int64_t end) {
  const int64_t group = num_heads / num_kv_heads, d = kD > 0 ? kD : head_dim;
  const int64_t token_stride = num_kv_heads * head_dim;  // one cache slot
  std::vector<float> qs(num_heads * d), acc(num_heads * d), buf(d);
  std::vector<float> m(num_heads), l(num_heads), scores(num_heads * block_size);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t len = seq_lens[b];
    for (int64_t i = 0; i < num_heads * d; ++i) qs[i] = to_float(q[b * ldq + i]) * scale;
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.end(), 0.f);
    for (int64_t start = 0; start < len; start += block_size) {
      const int64_t block = block_tables[b * table_width + start / block_size];
      const int64_t n = std::min(block_size, len - start);
      const T* keys = k_cache + block * block_size * token_stride;
      const T* values = v_cache + block * block_size * token_stride;
      // The next block's keys and values, a slot's worth per token of this
      // one, so they arrive while this block is computed (all at once, the
      // prefetches would stall the core waiting for free fill buffers).
      const bool more = start + block_size < len;
      const int64_t next = more ? block_tables[b * table_width + start / block_size + 1] : 0;
      const T* next_keys = k_cache + next * block_size * token_stride;
      const T* next_values = v_cache + next * block_size * token_stride;
      // Query heads h = j * G + g read KV head j.
      for (int64_t t = 0; t < n; ++t) {
        if (more) prefetch_slot(next_keys + t * token_stride, token_stride);
        for (int64_t j = 0; j < num_kv_heads; ++j) {
          const float* k = as_float(keys + t * token_stride + j * d, buf.data(), d);
          for (int64_t h = j * group; h < (j + 1) * group; ++h)
            scores[h * block_size + t] = dot(qs.data() + h * d, k, d);
        }
      }
      for (int64_t h = 0; h < num_heads; ++h)
        softmax_update(scores.data() + h * block_size, n, m[h], l[h], acc.data() + h * d, d);
      for (int64_t t = 0; t < n; ++t) {
        if (more) prefetch_slot(next_values + t * token_stride, token_stride);
        for (int64_t j = 0; j < num_kv_heads; ++j) {
          const float* v = as_float(values + t * token_stride + j * d, buf.data(), d);
          for (int64_t h = j * group; h < (j + 1) * group; ++h)
            axpy(scores[h * block_size + t], v, acc.data() + h * d, d);
        }
      }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
      T* o = out + (b * num_heads + h) * d;
      const float inv = 1.f / l[h];
      for (int64_t i = 0; i < d; ++i) o[i] = from_float<T>(acc[h * d + i] * inv);
    }
  }
}

// The head sizes of common models as compile-time constants, else any size.
template <typename T, typename... Args>
void attend_seqs_any(int64_t head_dim, Args... args) {
  switch (head_dim) {
    case 64: attend_seqs<T, 64>(args...); break;
    case 128: attend_seqs<T, 128>(args...); break;
    default: attend_seqs<T, 0>(args...);
  }
}

}  // namespace

// Every block a sequence reads must be in its table and in the cache: the
// kernel follows the table without bounds checks of its own.
void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_seqs, int64_t num_blocks, int64_t block_size) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs,
              "paged_decode_attention: block_tables must be [", num_seqs,
              ", W] and seq_lens [", num_seqs, "], got ", block_tables.sizes(), " and ",
              seq_lens.sizes());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t used = (lens[b] + block_size - 1) / block_size;
    TORCH_CHECK(lens[b] >= 1 && used <= width, "paged_decode_attention: seq_lens[", b, "] = ",
                lens[b], " needs ", used, " blocks; allowed: 1 to ", width * block_size,
                " tokens (", width, " table entries of ", block_size, ")");
    for (int64_t i = 0; i < used; ++i) {
      const int32_t block = tables[b * width + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block_tables[",
                  b, "][", i, "] = ", block, " is not a block of the cache (0 to ",
                  num_blocks - 1, ")");
    }
  }
}

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables
// [B, W] int32; seq_lens [B] int32 (each >= 1). Returns [B, H, D].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache,
                                     at::Tensor v_cache, at::Tensor block_tables,
                                     at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q must be [B, H, D] and the caches "
              "[num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and seq_lens must be int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3),
              "paged_decode_attention: heads or head_dim do not match the cache");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  check_block_tables(block_tables, seq_lens, q.size(0), k_cache.size(0), k_cache.size(1));
  auto out = at::empty_like(q);
  MINIVLLM_DISPATCH_FLOATS(q.scalar_type(), "paged_decode_attention", [&] {
    at::parallel_for(0, q.size(0), 1, [&](int64_t b, int64_t e) {
      attend_seqs_any<scalar_t>(q.size(2), q.data_ptr<scalar_t>(), q.size(1) * q.size(2),
                                k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                                out.data_ptr<scalar_t>(), q.size(1), k_cache.size(2), q.size(2),
                                k_cache.size(1), block_tables.size(1), static_cast<float>(scale),
                                b, e);
    });
  });
  return out;
}

void slice::paged_decode_attention(const float* q, int64_t ldq, const float* k_cache, const float* v_cache,
                                   const int32_t* block_tables, const int32_t* seq_lens,
                                   float* out, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_dim, int64_t block_size, int64_t table_width,
                                   float scale, int64_t begin, int64_t end) {
  attend_seqs_any<float>(head_dim, q, ldq, k_cache, v_cache, block_tables, seq_lens, out, num_heads,
                         num_kv_heads, head_dim, block_size, table_width, scale, begin, end);
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("paged_decode_attention", &minivllm::paged_decode_attention);
}
