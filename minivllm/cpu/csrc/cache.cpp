// Writing a step's new keys and values into their paged-cache slots.
//
// slot_mapping[t] is the flat slot (block * block_size + offset) of token t,
// or -1 for a token that stores nothing (padding). The keys and values may be
// strided views of the qkv projection output; each head vector is copied
// straight into the cache, with no gathered intermediate.
#include <ATen/Parallel.h>

#include <cstring>

#include "cpu_types.h"
#include "ops.h"

namespace minivllm {
namespace {

// Tokens [begin, end): token t's head h of key at key + (t * ldk + h * hsk) elements
// (value alike), esize bytes an element.
void cache_tokens(const char* key, int64_t ldk, int64_t hsk, const char* value, int64_t ldv,
                  int64_t hsv, char* key_cache, char* value_cache, const int64_t* slots,
                  int64_t heads, int64_t dim, int64_t esize, int64_t begin, int64_t end) {
  const int64_t bytes = dim * esize;
  for (int64_t t = begin; t < end; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = (slots[t] * heads + h) * bytes;
      std::memcpy(key_cache + dst, key + (t * ldk + h * hsk) * esize, bytes);
      std::memcpy(value_cache + dst, value + (t * ldv + h * hsv) * esize, bytes);
    }
  }
}

}  // namespace

void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                       at::Tensor value_cache, at::Tensor slot_mapping) {
  check_cpu(key, "reshape_and_cache", "key");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous(),
              "reshape_and_cache: caches must be contiguous [num_blocks, block_size, "
              "kv_heads, head_dim]");
  const int64_t tokens = key.size(0), heads = key_cache.size(2), dim = key_cache.size(3);
  for (const auto* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == heads &&
                    t->size(2) == dim && t->stride(2) == 1,
                "reshape_and_cache: key and value must be [", tokens, ", ", heads, ", ",
                dim, "] with contiguous head vectors, got ", t->sizes());
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == key_cache.scalar_type(),
              "reshape_and_cache: key, value and caches must share a dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                  slot_mapping.scalar_type() == at::kLong,
              "reshape_and_cache: slot_mapping must be int64 [", tokens, "]");
  auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] < num_slots, "reshape_and_cache: slot ", sp[t],
                " is outside the cache's ", num_slots, " slots");
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  at::parallel_for(0, tokens, row_grain(2 * heads * dim), [&](int64_t b, int64_t e) {
    cache_tokens(kp, key.stride(0), key.stride(1), vp, value.stride(0), value.stride(1), kc, vc,
                 sp, heads, dim, key.element_size(), b, e);
  });
}

void slice::reshape_and_cache(const float* key, int64_t ldk, const float* value, int64_t ldv,
                              float* key_cache, float* value_cache, const int64_t* slot_mapping,
                              int64_t heads, int64_t dim, int64_t begin, int64_t end) {
  // Heads side by side, as in the qkv projection's output.
  cache_tokens(reinterpret_cast<const char*>(key), ldk, dim,
               reinterpret_cast<const char*>(value), ldv, dim,
               reinterpret_cast<char*>(key_cache), reinterpret_cast<char*>(value_cache),
               slot_mapping, heads, dim, sizeof(float), begin, end);
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) { m.impl("reshape_and_cache", &minivllm::reshape_and_cache); }
