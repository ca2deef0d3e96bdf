// The gated MLPs' activation over the fused [gate; up] projection:
//   silu_and_mul:       out = silu(gate) * up          (SwiGLU: Llama, Qwen, ...)
//   gelu_tanh_and_mul:  out = gelu_tanh(gate) * up     (GeGLU: Gemma 3)
//
// PyTorch needs three passes (chunk views, the activation, mul) and an
// intermediate tensor; here each output value is produced from its two inputs
// at once.
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_types.h"
#include "ops.h"

namespace minivllm {
namespace {

// One row of GeGLU's gate, d values. The tanh approximation of GELU,
// 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), is g * sigmoid(2u)
// (the same identity), so it takes SiLU's vectorizable sigmoid: within float32
// rounding of torch's F.gelu(approximate="tanh"), not its bits. The Python
// layers' twin (cpu/gemma3.py) and the decode-step replay both call this.
template <typename T>
inline void gelu_tanh_and_mul_row(const T* gate, const T* up, T* out, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float g = to_float(gate[i]);
    const float u2 = 1.5957691216f * (g + 0.044715f * g * g * g);  // 2u
    const float e = exp_nonpositive(-std::abs(u2));
    const float sigmoid = (u2 >= 0.f ? 1.f : e) / (1.f + e);
    const T a = from_float<T>(g * sigmoid);  // rounded to the dtype first, as F.gelu is
    out[i] = from_float<T>(to_float(a) * to_float(up[i]));
  }
}

void check_gated(const at::Tensor& x, const char* op) {
  check_cpu(x, op, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1, op,
              ": x must be [rows, 2 * d] with contiguous rows, got ", x.sizes());
}

}  // namespace

at::Tensor gelu_tanh_and_mul(at::Tensor x) {
  check_gated(x, "gelu_tanh_and_mul");
  const int64_t d = x.size(1) / 2, ldx = x.stride(0);
  auto out = at::empty({x.size(0), d}, x.options());
  MINIVLLM_DISPATCH_FLOATS(x.scalar_type(), "gelu_tanh_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), row_grain(2 * d), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        gelu_tanh_and_mul_row(xp + r * ldx, xp + r * ldx + d, op + r * d, d);
    });
  });
  return out;
}

void slice::gelu_tanh_and_mul(const float* x, float* out, int64_t rows, int64_t d,
                              int64_t begin, int64_t end) {
  for (int64_t r = 0; r < rows; ++r)
    gelu_tanh_and_mul_row(x + r * 2 * d + begin, x + r * 2 * d + d + begin,
                          out + r * d + begin, end - begin);
}

at::Tensor silu_and_mul(at::Tensor x) {
  check_gated(x, "silu_and_mul");
  const int64_t d = x.size(1) / 2, ldx = x.stride(0);
  auto out = at::empty({x.size(0), d}, x.options());
  MINIVLLM_DISPATCH_FLOATS(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), row_grain(2 * d), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        silu_and_mul_row(xp + r * ldx, xp + r * ldx + d, op + r * d, d);
    });
  });
  return out;
}

void slice::silu_and_mul(const float* x, float* out, int64_t rows, int64_t d, int64_t begin,
                         int64_t end) {
  for (int64_t r = 0; r < rows; ++r)
    silu_and_mul_row(x + r * 2 * d + begin, x + r * 2 * d + d + begin, out + r * d + begin,
                     end - begin);
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("silu_and_mul", &minivllm::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &minivllm::gelu_tanh_and_mul);
}
