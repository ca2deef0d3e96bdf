// RMSNorm, alone or fused with the residual add that precedes it.
//
//   rms_norm(x, w)               = w * x / sqrt(mean(x^2) + eps)
//   fused_add_rms_norm(x, r, w):   r <- x + r (in place);  returns rms_norm(r, w)
//
// One pass per row instead of PyTorch's chain of elementwise ops (add, pow,
// mean, rsqrt, mul, mul), each of which reads and writes the whole batch.
// The sum of squares is taken in float32. For 16-bit inputs the rounding
// points follow the reference: the residual sum and the normalized value are
// rounded to the input dtype before the next use.
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_types.h"
#include "ops.h"

namespace minivllm {
namespace {

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const T normed = from_float<T>(to_float(x[i]) * inv);
    out[i] = from_float<T>(to_float(w[i]) * to_float(normed));
  }
}

void check(const at::Tensor& x, const at::Tensor& w, const char* op) {
  check_cpu(x, op, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [rows, hidden] with "
              "contiguous rows, got sizes ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), op,
              ": weight must be a contiguous [", x.size(1), "] vector");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": weight dtype ", w.scalar_type(),
              " differs from x dtype ", x.scalar_type());
}

template <typename T>
void add_row(const T* x, T* residual, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    residual[i] = from_float<T>(to_float(x[i]) + to_float(residual[i]));
}

// Rows [begin, end) of x normalized into out; with `residual`, each row of x
// is first added into it (in place) and the sum normalized instead.
template <typename T>
void norm_rows(const T* x, int64_t ldx, T* residual, const T* w, T* out, int64_t n, float eps,
               int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* src = x + r * ldx;
    if (residual != nullptr) {
      add_row(src, residual + r * n, n);
      src = residual + r * n;
    }
    norm_row(src, w, out + r * n, n, eps);
  }
}

at::Tensor norm_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight,
                     double eps) {
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), ldx = x.stride(0);
  MINIVLLM_DISPATCH_FLOATS(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* rp = residual != nullptr ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t b, int64_t e) {
      norm_rows(xp, ldx, rp, wp, op, n, float(eps), b, e);
    });
  });
  return out;
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check(x, weight, "rms_norm");
  return norm_rows(x, nullptr, weight, eps);
}

at::Tensor fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                              double eps) {
  check(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual must be contiguous, shaped and typed like x");
  return norm_rows(x, &residual, weight, eps);
}

void slice::rms_norm(const float* x, int64_t ldx, float* residual, const float* weight,
                     float* out, int64_t n, float eps, int64_t begin, int64_t end) {
  norm_rows(x, ldx, residual, weight, out, n, eps, begin, end);
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("rms_norm", &minivllm::rms_norm);
  m.impl("fused_add_rms_norm", &minivllm::fused_add_rms_norm);
}
