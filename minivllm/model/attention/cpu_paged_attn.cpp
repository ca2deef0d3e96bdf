// Paged decode attention for CPUs: one new query token per sequence, its keys
// and values read in place through the block table (never gathered into a
// padded copy, which is what the pure-PyTorch path has to do).
//
//   out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b,   K_b, V_b = the first
//   seq_lens[b] tokens of sequence b, token p in block block_tables[b][p / bs]
//
// One work item per (sequence, KV head): the G = H / Hkv query heads that share
// the KV head are handled together, so each key and value row is loaded once
// for all of them (grouped-query attention). Keys are visited block by block
// with the online softmax: a running maximum m, a running sum l and an
// accumulator rescaled whenever m grows, so one pass over the context suffices.
// Everything accumulates in float32, whatever the cache dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache,
                      const int32_t* block_tables, const int32_t* seq_lens, T* out,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t table_width,
                      float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // one cache slot
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(group * head_dim), acc(group * head_dim);
    std::vector<float> m(group), l(group), scores(group * block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, j = item % num_kv_heads;
      const int64_t len = seq_lens[b];
      for (int64_t g = 0; g < group; ++g) {
        const T* qh = q + (b * num_heads + j * group + g) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i)
          qs[g * head_dim + i] = static_cast<float>(qh[i]) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t block = block_tables[b * table_width + start / block_size];
        const int64_t n = std::min(block_size, len - start);
        const T* keys = k_cache + block * block_size * token_stride + j * head_dim;
        const T* values = v_cache + block * block_size * token_stride + j * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * block_size;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) {
            s[t] = dot(qs.data() + g * head_dim, keys + t * token_stride, head_dim);
            block_max = std::max(block_max, s[t]);
          }
          // Rescale what was accumulated under the old maximum.
          const float new_max = std::max(m[g], block_max);
          const float correction = std::exp(m[g] - new_max);
          float* a = acc.data() + g * head_dim;
          l[g] *= correction;
          for (int64_t i = 0; i < head_dim; ++i) a[i] *= correction;
          for (int64_t t = 0; t < n; ++t) {
            const float p = std::exp(s[t] - new_max);
            const T* v = values + t * token_stride;
            l[g] += p;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; ++i) a[i] += p * static_cast<float>(v[i]);
          }
          m[g] = new_max;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out + (b * num_heads + j * group + g) * head_dim;
        const float inv = 1.f / l[g];
        for (int64_t i = 0; i < head_dim; ++i)
          o[i] = static_cast<T>(acc[g * head_dim + i] * inv);
      }
    }
  });
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables
// [B, W] int32; seq_lens [B] int32 (each >= 1). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q must be [B, H, D] and the caches "
              "[num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 &&
                  seq_lens.scalar_type() == torch::kInt32,
              "paged_decode_attention: block_tables and seq_lens must be int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3),
              "paged_decode_attention: heads or head_dim do not match the cache");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
        decode_attention<scalar_t>(
            q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
            v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
            seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), q.size(0), q.size(1),
            k_cache.size(2), q.size(2), k_cache.size(1), block_tables.size(1),
            static_cast<float>(scale));
      });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention on CPU (keys/values read through block tables)");
}
