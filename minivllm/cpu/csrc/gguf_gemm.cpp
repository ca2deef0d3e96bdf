// Products with GGUF-quantized weights, read as they ship: y = x W^T (+ bias),
// W given as [N, row_bytes] bytes of one GGML block type (see
// minivllm/model/layers/quantization/ggml_types.py for the formats).
//
// A decode step is bandwidth-bound: what it costs is the bytes of the weights
// it streams. So the weights stay in their blocks in memory (0.56 bytes a
// weight for Q4_1, 1.06 for Q8_0, against 4 for float32) and each thread turns
// one weight row at a time into floats in a small buffer that stays in the L1
// cache, then multiplies it with every row of x. The arithmetic of a block is
// the reference's, in the same order (no fused multiply-add in the
// dequantization), so the weights it multiplies are bit for bit the float
// path's; only the summation order of the dot products differs, as with any
// change of GEMM kernel.
//
// gguf_dequantize writes a whole matrix out (the caller's large batches then
// take MKL's GEMM on it).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <vector>

#include "cpu_types.h"

namespace minivllm {
namespace {

enum GgmlType : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

struct TypeInfo {
  int64_t block, bytes;  // weights and bytes per block
};

TypeInfo type_info(int64_t t) {
  switch (t) {
    case F32: return {1, 4};
    case F16: return {1, 2};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
    default: TORCH_CHECK(false, "gguf: unsupported GGML type ", t);
  }
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

NO_CONTRACT void q4_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>((b[2 + i] & 0x0F) - 8);
    out[i + 16] = d * static_cast<float>((b[2 + i] >> 4) - 8);
  }
}

NO_CONTRACT void q4_1(const uint8_t* b, float* out) {
  const float d = f16(b), m = f16(b + 2);
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>(b[4 + i] & 0x0F) + m;
    out[i + 16] = d * static_cast<float>(b[4 + i] >> 4) + m;
  }
}

NO_CONTRACT void q8_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q[i]) * d;
}

NO_CONTRACT void q4_k(const uint8_t* b, float* out) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* s = b + 4;
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {  // sub-block j: 6-bit scale and min (ggml_types._k_scales_mins)
    const int sc = j < 4 ? s[j] & 0x3F : (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    const int mn = j < 4 ? s[j + 4] & 0x3F : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    const float scale = d * static_cast<float>(sc), shift = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shiftbits = 4 * (j % 2);
    for (int i = 0; i < 32; ++i)
      out[32 * j + i] = scale * static_cast<float>((q[i] >> shiftbits) & 0x0F) - shift;
  }
}

NO_CONTRACT void q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int h = 0; h < 2; ++h)  // two halves of 128 weights
    for (int g = 0; g < 4; ++g)  // groups of 32: low or high nibbles of 32 ql bytes
      for (int i = 0; i < 32; ++i) {
        const int idx = 128 * h + 32 * g + i;
        const int lo = (ql[64 * h + 32 * (g % 2) + i] >> (4 * (g / 2))) & 0x0F;
        const int hi = (qh[32 * h + i] >> (2 * g)) & 0x03;
        const float scale = d * static_cast<float>(sc[idx / 16]);
        out[idx] = scale * static_cast<float>((lo | (hi << 4)) - 32);
      }
}

// One row of K weights into floats.
void dequantize_row(int64_t t, const uint8_t* row, int64_t K, float* out) {
  switch (t) {
    case F32: std::memcpy(out, row, K * 4); return;
    case F16:
      for (int64_t i = 0; i < K; ++i) out[i] = f16(row + 2 * i);
      return;
    default: break;
  }
  const TypeInfo ti = type_info(t);
  void (*block)(const uint8_t*, float*) =
      t == Q4_0 ? q4_0 : t == Q4_1 ? q4_1 : t == Q8_0 ? q8_0 : t == Q4_K ? q4_k : q6_k;
  for (int64_t k = 0, i = 0; k < K; k += ti.block, ++i) block(row + i * ti.bytes, out + k);
}

inline float dot(const float* a, const float* b, int64_t K) {
#ifdef MINIVLLM_VEC
  constexpr int64_t L = vec::kLanes;
  vec::vf acc0 = vec::zero(), acc1 = vec::zero();
  int64_t k = 0;
  for (; k + 2 * L <= K; k += 2 * L) {
    acc0 = vec::fmadd(vec::load(a + k), vec::load(b + k), acc0);
    acc1 = vec::fmadd(vec::load(a + k + L), vec::load(b + k + L), acc1);
  }
  float s = vec::reduce_add(vec::add(acc0, acc1));
  for (; k < K; ++k) s += a[k] * b[k];
  return s;
#else
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) s += a[k] * b[k];
  return s;
#endif
}

void check_qweight(const at::Tensor& q, int64_t t, int64_t K, const char* op) {
  check_cpu(q, op, "qweight");
  const TypeInfo ti = type_info(t);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(), op,
              ": qweight must be contiguous uint8 [N, row_bytes], got ", q.scalar_type(), " ",
              q.sizes());
  TORCH_CHECK(K % ti.block == 0 && q.size(1) == K / ti.block * ti.bytes, op, ": ", K,
              " columns of type ", t, " take ", K / ti.block * ti.bytes, " bytes a row, got ",
              q.size(1));
}

}  // namespace

// y [M, N] = x [M, K] W^T (+ bias), W [N, K] as blocks of GGML type `qtype`.
at::Tensor gguf_linear(at::Tensor x, at::Tensor qweight, int64_t qtype,
                       c10::optional<at::Tensor> bias) {
  check_cpu(x, "gguf_linear", "x");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "gguf_linear: x must be float32 "
              "[rows, K], got ", x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  check_qweight(qweight, qtype, K, "gguf_linear");
  x = x.contiguous();
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == N && b.scalar_type() == at::kFloat, "gguf_linear: bias must be "
                "float32 [", N, "]");
    bp = b.data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const int64_t row_bytes = qweight.size(1);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      if (n + 1 < end)  // the next row's blocks on their way while this one is used
        for (int64_t o = 0; o < row_bytes; o += 64)
          __builtin_prefetch(w + (n + 1) * row_bytes + o);
      dequantize_row(qtype, w + n * row_bytes, K, row.data());
      const float add = bp != nullptr ? bp[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot(xp + m * K, row.data(), K) + add;
    }
  });
  return y;
}

at::Tensor gguf_dequantize(at::Tensor qweight, int64_t qtype, int64_t cols) {
  check_qweight(qweight, qtype, cols, "gguf_dequantize");
  const int64_t N = qweight.size(0), row_bytes = qweight.size(1);
  auto out = at::empty({N, cols}, qweight.options().dtype(at::kFloat));
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequantize_row(qtype, w + n * row_bytes, cols, o + n * cols);
  });
  return out;
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("gguf_linear(Tensor x, Tensor qweight, int qtype, Tensor? bias) -> Tensor");
  m.def("gguf_dequantize(Tensor qweight, int qtype, int cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("gguf_linear", &minivllm::gguf_linear);
  m.impl("gguf_dequantize", &minivllm::gguf_dequantize);
}
