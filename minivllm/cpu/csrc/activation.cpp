// SwiGLU's gate over the fused [gate; up] projection: out = silu(gate) * up.
//
// PyTorch needs three passes (chunk views, silu, mul) and an intermediate
// tensor; here each output value is produced from its two inputs at once.
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_types.h"
#include "ops.h"

namespace minivllm {

at::Tensor silu_and_mul(at::Tensor x) {
  check_cpu(x, "silu_and_mul", "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1,
              "silu_and_mul: x must be [rows, 2 * d] with contiguous rows, got ", x.sizes());
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

TORCH_LIBRARY_FRAGMENT(minivllm, m) { m.def("silu_and_mul(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(minivllm, CPU, m) { m.impl("silu_and_mul", &minivllm::silu_and_mul); }
