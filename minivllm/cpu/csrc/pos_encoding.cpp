// Rotary position embedding, in place on the query and key heads.
//
// "Rotate half" layout: dimension i pairs with i + D/2. The caches hold, per
// position, cos duplicated over both halves and sin with the rotate-half sign
// folded in (-sin on the first half, +sin on the second), so
//   x'[i] = x[i] * cos[i] + x[partner(i)] * sin[i].
// q and k may be strided views (slices of the fused qkv projection output):
// rotating them in place saves PyTorch's chunk/cat/mul/addcmul temporaries.
#include <ATen/Parallel.h>

#include "cpu_types.h"
#include "ops.h"

namespace minivllm {
namespace {

template <typename T>
void rotate_head(T* x, const float* c, const float* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    x[i] = from_float<T>(x1 * c[i] + x2 * s[i]);
    x[i + half] = from_float<T>(x2 * c[i + half] + x1 * s[i + half]);
  }
}

// Tokens [begin, end): token t's head h of q at q + t * ldq + h * hsq (k alike).
template <typename T>
void rotate_tokens(const int64_t* positions, T* q, int64_t ldq, int64_t hsq, int64_t hq, T* k,
                   int64_t ldk, int64_t hsk, int64_t hk, const float* cos_cache,
                   const float* sin_cache, int64_t dim, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float* c = cos_cache + positions[t] * dim;
    const float* s = sin_cache + positions[t] * dim;
    for (int64_t h = 0; h < hq; ++h) rotate_head(q + t * ldq + h * hsq, c, s, dim / 2);
    for (int64_t h = 0; h < hk; ++h) rotate_head(k + t * ldk + h * hsk, c, s, dim / 2);
  }
}

void check_heads(const at::Tensor& t, const char* name, int64_t tokens, int64_t dim) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == tokens && t.size(2) == dim && t.stride(2) == 1,
              "rotary_embedding: ", name, " must be [", tokens, ", heads, ", dim,
              "] with contiguous head vectors, got sizes ", t.sizes(), " strides ", t.strides());
}

}  // namespace

void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k,
                      at::Tensor cos_cache, at::Tensor sin_cache) {
  check_cpu(q, "rotary_embedding", "q");
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong,
              "rotary_embedding: positions must be a 1-D int64 tensor");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && cos_cache.is_contiguous() &&
                  sin_cache.sizes() == cos_cache.sizes() && sin_cache.is_contiguous() &&
                  sin_cache.scalar_type() == at::kFloat,
              "rotary_embedding: cos_cache and sin_cache must be contiguous float32 [P, D]");
  const int64_t tokens = positions.size(0), dim = cos_cache.size(1);
  TORCH_CHECK(dim % 2 == 0, "rotary_embedding: head_dim must be even, got ", dim);
  check_heads(q, "q", tokens, dim);
  check_heads(k, "k", tokens, dim);
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_embedding: q and k dtypes differ");
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary_embedding: position ", pp[t],
                " is outside the cache's [0, ", max_pos, ")");
  const float* cp = cos_cache.data_ptr<float>();
  const float* sp = sin_cache.data_ptr<float>();
  const int64_t hq = q.size(1), hk = k.size(1);
  MINIVLLM_DISPATCH_FLOATS(q.scalar_type(), "rotary_embedding", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, row_grain((hq + hk) * dim), [&](int64_t b, int64_t e) {
      rotate_tokens(pp, qp, q.stride(0), q.stride(1), hq, kp, k.stride(0), k.stride(1), hk, cp,
                    sp, dim, b, e);
    });
  });
}

void slice::rotary_embedding(const int64_t* positions, float* q, int64_t ldq, int64_t hq,
                             float* k, int64_t ldk, int64_t hk, const float* cos_cache,
                             const float* sin_cache, int64_t dim, int64_t begin, int64_t end) {
  // Heads side by side, as in the qkv projection's output.
  rotate_tokens(positions, q, ldq, dim, hq, k, ldk, dim, hk, cos_cache, sin_cache, dim, begin,
                end);
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_cache, "
        "Tensor sin_cache) -> ()");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) { m.impl("rotary_embedding", &minivllm::rotary_embedding); }
