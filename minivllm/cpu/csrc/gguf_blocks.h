// The GGML block types the GGUF kernels read (gguf_gemm.cpp, gguf_int8.cpp;
// the layouts: minivllm/model/layers/quantization/ggml_types.py).
#pragma once

#include <cstdint>

namespace minivllm {
namespace gguf {

enum GgmlType : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

// Bytes of one block of the 32-weight types: float16 d (Q4_1: d, m), then the weights.
constexpr int64_t block_bytes(int64_t t) { return t == Q4_0 ? 18 : t == Q4_1 ? 20 : 34; }

}  // namespace gguf
}  // namespace minivllm
