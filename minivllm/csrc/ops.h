// The kernels' tensor-level entry points, for C++ callers (llama_decode.cpp
// runs a whole decode step through them without going back to Python).
#pragma once

#include <ATen/ATen.h>

namespace minivllm {

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache,
                      at::Tensor sin_cache);
at::Tensor silu_and_mul(at::Tensor x);
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                       at::Tensor value_cache, at::Tensor slot_mapping);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale);
bool packed_linear_available();
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, int64_t out_features,
                         c10::optional<at::Tensor> bias);
at::Tensor matvec(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);

}  // namespace minivllm
