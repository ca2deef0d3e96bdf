// A mixture of experts' expert sum in one call: the step's (token, expert)
// pairs grouped by expert, each expert's rows multiplied once by its
// [gate; up] weight with SiLU-and-mul applied on the way out, then by its
// down weight, and the weighted rows added back into their tokens
// (fused_moe.expert_sum's steps 3-5; the router stays in Python).
//
// It reads the experts' ordinary stacked weights, w13 [E, 2I, H] and w2
// [E, H, I] (float32, bfloat16 or float16), so the CPU path keeps ONE copy of
// them: no packed layout beside the originals. A decode step gives each
// expert a few rows (32 sequences x top-8 over 64 experts: about 4), so the
// product is a stream over the expert's weight rows, each row dotted with all
// of the expert's input rows while it is in L1 (`dot2`: two weight rows x four
// input rows, eight vector accumulators). An expert with many rows (a
// prefill) takes ATen's GEMM on its weight instead, where the weight is
// reused enough for a cache-blocked kernel to pay.
//
// Work items are (expert, block of output columns), in weight order: OpenMP
// threads take them in guided chunks, so each core streams long runs of
// contiguous rows (one item at a time gave each core every other item, and
// its stream restarted at each) and a descheduled core's share still goes to
// the other. Inputs are converted to float32 when gathered (bfloat16 experts
// on a CPU with AVX512-BF16: rounded back to bfloat16, for vdpbf16ps); sums
// are float32; the output takes the hidden states' dtype. Results equal the reference's up to float rounding
// (another summation order).
//
// moe_expert_sum_gguf is the same sum on quantized experts (Q8_0 blocks,
// quantization="q8_0"): each expert's rows through gguf_gemm.cpp's product on
// its blocks (block_products below), float32 activations.
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_types.h"
#include "ops.h"

namespace minivllm {
namespace {

// Rows above this take ATen's GEMM (measured on the benchmark MoE: the
// streaming kernel wins at a decode step's few rows, a blocked GEMM at a
// prefill's hundreds).
constexpr int64_t kStreamMaxRows = 48;
// Output columns per work item.
constexpr int64_t kBlock = 16;
// How many weight rows ahead the streaming products prefetch: [gate; up]
// rows of H values, down rows of I values (fewer bytes a row: further ahead).
constexpr int64_t kAheadUp = 4, kAheadDown = 16;

// The pairs sorted by expert (a counting sort, stable): pair p of the sorted
// order is (token token[p], slot) with position pos[token * k + slot] = p;
// experts' rows are [start[e], start[e + 1]). An id outside [0, E) is a pair
// another rank computes (expert parallelism): pos -1.
struct Groups {
  std::vector<int64_t> start, token, pos;
};

Groups group_pairs(const int64_t* ids, int64_t T, int64_t k, int64_t E) {
  Groups g;
  g.start.assign(E + 1, 0);
  g.pos.assign(T * k, -1);
  for (int64_t i = 0; i < T * k; ++i)
    if (ids[i] >= 0 && ids[i] < E) ++g.start[ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  g.token.resize(g.start[E]);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t e = ids[i];
    if (e < 0 || e >= E) continue;
    const int64_t p = next[e]++;
    g.token[p] = i / k;
    g.pos[i] = p;
  }
  return g;
}

#ifdef MINIVLLM_VEC
using vec::vf;
constexpr int64_t L = vec::kLanes;

// s0[r] = x_r . w0 and s1[r] = x_r . w1 for R (<= 4) float32 rows of x (row
// stride K) and two weight rows of K values. With p0 and p1, rows further on
// are prefetched into L2 meanwhile, a line each per vector step: a weight row
// is a page or less (4 KB at 1,024 float32 values), and the hardware
// prefetcher stops at every page boundary, so without them each row began
// with a wait on memory.
template <int R, typename W>
inline void dot2(const float* x, int64_t K, const W* w0, const W* w1, float* s0, float* s1,
                 const W* p0 = nullptr, const W* p1 = nullptr) {
  vf a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = vec::zero();
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    if (p0 != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(p0 + k), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p1 + k), _MM_HINT_T1);
    }
    const vf v0 = vec::load(w0 + k), v1 = vec::load(w1 + k);
    for (int r = 0; r < R; ++r) {
      const vf xr = vec::load(x + r * K + k);
      a0[r] = vec::fmadd(xr, v0, a0[r]);
      a1[r] = vec::fmadd(xr, v1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float t0 = vec::reduce_add(a0[r]), t1 = vec::reduce_add(a1[r]);
    for (int64_t kk = k; kk < K; ++kk) {  // K not a multiple of the lanes
      t0 += x[r * K + kk] * to_float(w0[kk]);
      t1 += x[r * K + kk] * to_float(w1[kk]);
    }
    s0[r] = t0;
    s1[r] = t1;
  }
}

#ifdef __AVX512BF16__
// dot2 for bfloat16 rows against bfloat16 weights, on a CPU with AVX512-BF16:
// vdpbf16ps multiplies 32 pairs a step into 16 float32 sums, twice the
// values an instruction of dot2's converted loads (a bfloat16 step of dot2
// is bound by its FMAs, not by memory).
using bf16 = c10::BFloat16;
inline __m512bh load_pairs(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

template <int R>
inline void dot2(const bf16* x, int64_t K, const bf16* w0, const bf16* w1, float* s0, float* s1,
                 const bf16* p0 = nullptr, const bf16* p1 = nullptr) {
  vf a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = vec::zero();
  int64_t k = 0;
  for (; k + 2 * L <= K; k += 2 * L) {  // one cache line of each row a step
    if (p0 != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(p0 + k), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p1 + k), _MM_HINT_T1);
    }
    const __m512bh v0 = load_pairs(w0 + k), v1 = load_pairs(w1 + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = load_pairs(x + r * K + k);
      a0[r] = _mm512_dpbf16_ps(a0[r], xr, v0);
      a1[r] = _mm512_dpbf16_ps(a1[r], xr, v1);
    }
  }
  for (int r = 0; r < R; ++r) {
    float t0 = vec::reduce_add(a0[r]), t1 = vec::reduce_add(a1[r]);
    for (int64_t kk = k; kk < K; ++kk) {
      t0 += to_float(x[r * K + kk]) * to_float(w0[kk]);
      t1 += to_float(x[r * K + kk]) * to_float(w1[kk]);
    }
    s0[r] = t0;
    s1[r] = t1;
  }
}
#endif

// dot2 over n rows, four at a time; the first four prefetch p0 and p1.
template <typename X, typename W>
inline void dot2_rows(const X* x, int64_t n, int64_t K, const W* w0, const W* w1, float* s0,
                      float* s1, const W* p0, const W* p1) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4, p0 = p1 = nullptr) dot2<4>(x + r * K, K, w0, w1, s0 + r, s1 + r, p0, p1);
  switch (n - r) {
    case 3: dot2<3>(x + r * K, K, w0, w1, s0 + r, s1 + r, p0, p1); break;
    case 2: dot2<2>(x + r * K, K, w0, w1, s0 + r, s1 + r, p0, p1); break;
    case 1: dot2<1>(x + r * K, K, w0, w1, s0 + r, s1 + r, p0, p1); break;
    default: break;
  }
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// act [n, I] columns [j0, j1) = silu(x W_gate^T) * (x W_up^T) for one expert's
// n rows x [n, H]; w13 its [2I, H] weight.
template <typename X, typename W>
void gate_up_block(const X* x, int64_t n, int64_t H, const W* w13, int64_t I, float* act,
                   int64_t j0, int64_t j1) {
  float g[kStreamMaxRows], u[kStreamMaxRows];
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t next = j + kAheadUp;  // within the expert's [gate; up] rows
    dot2_rows(x, n, H, w13 + j * H, w13 + (I + j) * H, g, u, w13 + next * H,
              w13 + std::min(2 * I - 1, I + next) * H);
    for (int64_t r = 0; r < n; ++r) act[r * I + j] = silu(g[r]) * u[r];
  }
}

// y [n, H] columns [j0, j1) = act W_down^T for one expert; w2 its [H, I] weight.
template <typename X, typename W>
void down_block(const X* act, int64_t n, int64_t I, const W* w2, int64_t H, float* y,
                int64_t j0, int64_t j1) {
  float a[kStreamMaxRows], b[kStreamMaxRows];
  int64_t j = j0;
  for (; j + 2 <= j1; j += 2) {
    const int64_t next = std::min(H - 2, j + kAheadDown);
    dot2_rows(act, n, I, w2 + j * I, w2 + (j + 1) * I, a, b, w2 + next * I, w2 + (next + 1) * I);
    for (int64_t r = 0; r < n; ++r) {
      y[r * H + j] = a[r];
      y[r * H + j + 1] = b[r];
    }
  }
  if (j < j1) {  // an odd last column: its row twice, the second result dropped
    dot2_rows(act, n, I, w2 + j * I, w2 + j * I, a, b, w2 + j * I, w2 + j * I);
    for (int64_t r = 0; r < n; ++r) y[r * H + j] = a[r];
  }
}

// The streaming experts' items: (expert, block) pairs, blocks of kBlock columns.
struct Item {
  int64_t expert, j0, j1;
};

std::vector<Item> stream_items(const Groups& g, int64_t E, int64_t cols) {
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = g.start[e + 1] - g.start[e];
    if (n == 0 || n > kStreamMaxRows) continue;
    for (int64_t j = 0; j < cols; j += kBlock) items.push_back({e, j, std::min(cols, j + kBlock)});
  }
  return items;
}

// The streaming experts' products, threads over (expert, column block) items:
// act = silu-and-mul of x's [gate; up] product, then act_in (act as the down
// product reads it: act itself, or rounded to bfloat16) times the down rows.
// Guided chunks: contiguous rows for each core's stream, and on a shared
// machine a thread that is descheduled leaves its later items to the others
// instead of holding everyone at the end of a static split.
template <typename X, typename W>
void stream_products(const Groups& g, int64_t E, int64_t H, int64_t I, const X* xp, const W* w13p,
                     const W* w2p, float* ap, X* act_in, float* yp) {
  const auto up_items = stream_items(g, E, I), down_items = stream_items(g, E, H);
  const int64_t n_up = up_items.size(), n_down = down_items.size();
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp for schedule(guided)
    for (int64_t i = 0; i < n_up; ++i) {
      const Item& it = up_items[i];
      const int64_t s = g.start[it.expert], n = g.start[it.expert + 1] - s;
      gate_up_block(xp + s * H, n, H, w13p + it.expert * 2 * I * H, I, ap + s * I, it.j0, it.j1);
    }
    if constexpr (!std::is_same_v<X, float>) {
#pragma omp for schedule(static)
      for (int64_t p = 0; p < g.start[E]; ++p)
        for (int64_t j = 0; j < I; ++j) act_in[p * I + j] = static_cast<X>(ap[p * I + j]);
    }
#pragma omp for schedule(guided)
    for (int64_t i = 0; i < n_down; ++i) {
      const Item& it = down_items[i];
      const int64_t s = g.start[it.expert], n = g.start[it.expert + 1] - s;
      down_block(act_in + s * I, n, I, w2p + it.expert * H * I, H, yp + s * H, it.j0, it.j1);
    }
  }
}

template <typename W>
void expert_products(const at::Tensor& xs, const Groups& g, const at::Tensor& w13,
                     const at::Tensor& w2, at::Tensor& act, at::Tensor& ys) {
  const int64_t E = w13.size(0), H = w13.size(2), I = w2.size(2);
  const W* w13p = w13.data_ptr<W>();
  const W* w2p = w2.data_ptr<W>();
  float* xp = xs.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  float* yp = ys.data_ptr<float>();
  // Experts with many rows: ATen's (multi-threaded) GEMM, one expert at a time.
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = g.start[e], n = g.start[e + 1] - s;
    if (n <= kStreamMaxRows) continue;
    auto x = xs.narrow(0, s, n);
    auto h = at::matmul(x.to(w13.scalar_type()), w13[e].t()).to(at::kFloat);
    act.narrow(0, s, n).copy_(silu_and_mul(h));
    ys.narrow(0, s, n).copy_(at::matmul(act.narrow(0, s, n).to(w2.scalar_type()), w2[e].t()));
  }
  // The rest: the streaming kernel.
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<W, c10::BFloat16>) {  // bfloat16 rows: vdpbf16ps
    // The hidden states were bfloat16 (exact); the activation is rounded as the
    // reference's bfloat16 product rounds it.
    auto xs_bh = xs.to(at::kBFloat16), act_bh = at::empty_like(act, at::kBFloat16);
    stream_products(g, E, H, I, xs_bh.data_ptr<W>(), w13p, w2p, ap, act_bh.data_ptr<W>(), yp);
    return;
  }
#endif
  stream_products(g, E, H, I, xp, w13p, w2p, ap, ap, yp);
}


// The same products on GGUF blocks (quantization="q8_0" at load): w13q
// [E, 2I, row_bytes(H)] and w2q [E, H, row_bytes(I)] uint8. An expert's rows
// go through gguf_gemm.cpp's product on its blocks (slice::gguf_linear, the
// dense layers' code: each block dequantized in registers, in the reference's
// arithmetic, and used for all the expert's rows), one unit of output rows an
// item: for [gate; up] the unit's gate rows and its up rows, then SiLU-and-mul.
struct UnitItem {
  int64_t expert, unit;
};

std::vector<UnitItem> unit_items(const Groups& g, int64_t E, int64_t N) {
  std::vector<UnitItem> items;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = g.start[e + 1] - g.start[e];
    if (n == 0 || n > slice::gguf_max_rows) continue;
    for (int64_t u = 0; u * slice::gguf_unit(n) < N; ++u) items.push_back({e, u});
  }
  return items;
}

void block_products(const at::Tensor& xs, const Groups& g, const at::Tensor& w13q,
                    const at::Tensor& w2q, int64_t qtype, at::Tensor& act, at::Tensor& ys) {
  const int64_t E = w13q.size(0), H = w2q.size(1), I = act.size(1);
  const int64_t rb13 = w13q.size(2), rb2 = w2q.size(2);
  auto gu = at::empty({xs.size(0), 2 * I}, xs.options());  // each pair's gate | up
  const uint8_t* w13p = w13q.data_ptr<uint8_t>();
  const uint8_t* w2p = w2q.data_ptr<uint8_t>();
  const float* xp = xs.data_ptr<float>();
  float* gp = gu.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  float* yp = ys.data_ptr<float>();
  // Experts past gguf_max_rows: their blocks dequantized, then ATen's GEMM (as gguf_linear).
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = g.start[e], n = g.start[e + 1] - s;
    if (n <= slice::gguf_max_rows) continue;
    auto h = at::linear(xs.narrow(0, s, n), gguf_dequantize(w13q[e], qtype, H));
    act.narrow(0, s, n).copy_(silu_and_mul(h));
    ys.narrow(0, s, n).copy_(at::linear(act.narrow(0, s, n), gguf_dequantize(w2q[e], qtype, I)));
  }
  const auto up_items = unit_items(g, E, I), down_items = unit_items(g, E, H);
  const int64_t n_up = up_items.size(), n_down = down_items.size();
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_up; ++i) {
      const int64_t e = up_items[i].expert, u = up_items[i].unit;
      const int64_t s = g.start[e], n = g.start[e + 1] - s;
      const uint8_t* w = w13p + e * 2 * I * rb13;
      float* h = gp + s * 2 * I;
      slice::gguf_linear(xp + s * H, n, H, w, rb13, qtype, I, nullptr, h, 2 * I, u, u + 1);
      slice::gguf_linear(xp + s * H, n, H, w + I * rb13, rb13, qtype, I, nullptr, h + I, 2 * I,
                         u, u + 1);
      const int64_t j0 = u * slice::gguf_unit(n), j1 = std::min(I, j0 + slice::gguf_unit(n));
      for (int64_t r = 0; r < n; ++r)
        for (int64_t j = j0; j < j1; ++j)
          ap[(s + r) * I + j] = silu(h[r * 2 * I + j]) * h[r * 2 * I + I + j];
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_down; ++i) {
      const int64_t e = down_items[i].expert, u = down_items[i].unit;
      const int64_t s = g.start[e], n = g.start[e + 1] - s;
      slice::gguf_linear(ap + s * I, n, I, w2p + e * H * rb2, rb2, qtype, H, nullptr, yp + s * H,
                         H, u, u + 1);
    }
  }
}
#endif  // MINIVLLM_VEC

template <typename T>
void gather_rows(const at::Tensor& hidden, const Groups& g, float* xs, int64_t H) {
  const T* h = hidden.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(g.token.size()), 16, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t c = 0; c < H; ++c) xs[p * H + c] = to_float(h[g.token[p] * H + c]);
  });
}

// out[t] = sum over t's pairs of weight * ys[pair] (pairs of other ranks: nothing).
template <typename T>
void combine(const float* ys, const float* weights, const Groups& g, int64_t T_, int64_t k,
             int64_t H, T* out) {
  at::parallel_for(0, T_, 1, [&](int64_t b, int64_t e) {
    std::vector<float> acc(H);
    for (int64_t t = b; t < e; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = g.pos[t * k + j];
        if (p < 0) continue;
        const float w = weights[t * k + j];
        for (int64_t c = 0; c < H; ++c) acc[c] += w * ys[p * H + c];
      }
      for (int64_t c = 0; c < H; ++c) out[t * H + c] = from_float<T>(acc[c]);
    }
  });
}

}  // namespace

bool moe_expert_sum_available() {
#ifdef MINIVLLM_VEC
  return true;
#else
  return false;
#endif
}

namespace {

// Checks the routing tensors; returns ids as contiguous int64.
at::Tensor checked_ids(const at::Tensor& hidden, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, int64_t H, const char* op) {
  check_cpu(hidden, op, "hidden");
  TORCH_CHECK(moe_expert_sum_available(), op, ": this build has neither AVX-512 nor AVX2 + FMA");
  const int64_t T = hidden.size(0);
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == H, op, ": hidden must be [T, ", H,
              "], got ", hidden.sizes());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                  topk_weights.sizes() == topk_ids.sizes() &&
                  topk_weights.scalar_type() == at::kFloat,
              op, ": topk_ids and topk_weights (float32) must be [", T, ", k], got ",
              topk_ids.sizes(), " and ", topk_weights.scalar_type(), " ", topk_weights.sizes());
  return topk_ids.to(at::kLong).contiguous();
}

// Steps 3-5 around `products` (xs, groups, act, ys): the pairs grouped, their
// rows gathered as float32, and the weighted rows added into their tokens.
template <typename Products>
at::Tensor expert_sum(at::Tensor hidden, const at::Tensor& ids, at::Tensor weights, int64_t E,
                      int64_t I, const Products& products) {
  hidden = hidden.contiguous();
  weights = weights.contiguous();
  const int64_t T = hidden.size(0), H = hidden.size(1), k = ids.size(1);
  const Groups g = group_pairs(ids.data_ptr<int64_t>(), T, k, E);
  const int64_t P = g.start[E];
  auto fopts = hidden.options().dtype(at::kFloat);
  auto xs = at::empty({P, H}, fopts), act = at::empty({P, I}, fopts), ys = at::empty({P, H}, fopts);
  auto out = at::empty({T, H}, hidden.options());
#ifdef MINIVLLM_VEC
  const auto htype = hidden.scalar_type();
  TORCH_CHECK(htype == at::kFloat || htype == at::kBFloat16 || htype == at::kHalf,
              "moe_expert_sum: hidden must be float32, bfloat16 or float16, got ", htype);
  if (htype == at::kFloat) gather_rows<float>(hidden, g, xs.data_ptr<float>(), H);
  else if (htype == at::kBFloat16) gather_rows<c10::BFloat16>(hidden, g, xs.data_ptr<float>(), H);
  else gather_rows<c10::Half>(hidden, g, xs.data_ptr<float>(), H);
  products(xs, g, act, ys);
  const float* yp = ys.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  if (htype == at::kFloat) combine(yp, wp, g, T, k, H, out.data_ptr<float>());
  else if (htype == at::kBFloat16) combine(yp, wp, g, T, k, H, out.data_ptr<c10::BFloat16>());
  else combine(yp, wp, g, T, k, H, out.data_ptr<c10::Half>());
#endif
  return out;
}

}  // namespace

// hidden [T, H]; w13 [E, 2I, H] and w2 [E, H, I] contiguous, of one dtype
// (float32, bfloat16 or float16); topk_ids [T, k] (an id outside [0, E): not
// this rank's); topk_weights [T, k] float32. Returns [T, H] in hidden's dtype.
at::Tensor moe_expert_sum(at::Tensor hidden, at::Tensor w13, at::Tensor w2, at::Tensor topk_ids,
                          at::Tensor topk_weights) {
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.scalar_type() == w2.scalar_type() && w2.size(0) == w13.size(0) &&
                  w13.size(1) == 2 * w2.size(2) && w2.size(1) == w13.size(2),
              "moe_expert_sum: w13 must be [E, 2I, H] and w2 [E, H, I], contiguous, one dtype; "
              "got ", w13.sizes(), " and ", w2.sizes());
  const auto wtype = w13.scalar_type();
  TORCH_CHECK(wtype == at::kFloat || wtype == at::kBFloat16 || wtype == at::kHalf,
              "moe_expert_sum: experts must be float32, bfloat16 or float16, got ", wtype);
  const int64_t H = w13.size(2);
  const auto ids = checked_ids(hidden, topk_ids, topk_weights, H, "moe_expert_sum");
  return expert_sum(hidden, ids, topk_weights, w13.size(0), w2.size(2),
                    [&](const at::Tensor& xs, const Groups& g, at::Tensor& act, at::Tensor& ys) {
#ifdef MINIVLLM_VEC
    if (wtype == at::kFloat) expert_products<float>(xs, g, w13, w2, act, ys);
    else if (wtype == at::kBFloat16) expert_products<c10::BFloat16>(xs, g, w13, w2, act, ys);
    else expert_products<c10::Half>(xs, g, w13, w2, act, ys);
#endif
  });
}

// moe_expert_sum on GGUF blocks: w13q [E, 2I, row_bytes(H)] and w2q
// [E, H, row_bytes(I)] uint8 of GGML type qtype; hidden float32.
at::Tensor moe_expert_sum_gguf(at::Tensor hidden, at::Tensor w13q, at::Tensor w2q,
                               int64_t qtype, at::Tensor topk_ids, at::Tensor topk_weights) {
  TORCH_CHECK(w13q.dim() == 3 && w2q.dim() == 3 && w13q.is_contiguous() && w2q.is_contiguous() &&
                  w13q.scalar_type() == at::kByte && w2q.scalar_type() == at::kByte &&
                  w2q.size(0) == w13q.size(0) && w13q.size(1) % 2 == 0,
              "moe_expert_sum_gguf: w13q must be [E, 2I, row_bytes] and w2q [E, H, row_bytes], "
              "contiguous uint8; got ", w13q.scalar_type(), " ", w13q.sizes(), " and ",
              w2q.scalar_type(), " ", w2q.sizes());
  const int64_t H = w2q.size(1), I = w13q.size(1) / 2;
  TORCH_CHECK(gguf_row_bytes(qtype, H) == w13q.size(2) && gguf_row_bytes(qtype, I) == w2q.size(2),
              "moe_expert_sum_gguf: rows of ", H, " and ", I, " weights of GGML type ", qtype,
              " take ", gguf_row_bytes(qtype, H), " and ", gguf_row_bytes(qtype, I),
              " bytes (-1: not a type or width the kernels take), got ", w13q.size(2), " and ",
              w2q.size(2));
  TORCH_CHECK(hidden.scalar_type() == at::kFloat, "moe_expert_sum_gguf: hidden must be float32, "
              "got ", hidden.scalar_type());
  const auto ids = checked_ids(hidden, topk_ids, topk_weights, H, "moe_expert_sum_gguf");
  return expert_sum(hidden, ids, topk_weights, w13q.size(0), I,
                    [&](const at::Tensor& xs, const Groups& g, at::Tensor& act, at::Tensor& ys) {
#ifdef MINIVLLM_VEC
    block_products(xs, g, w13q, w2q, qtype, act, ys);
#endif
  });
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("moe_expert_sum_available() -> bool");
  m.def("moe_expert_sum(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_ids, "
        "Tensor topk_weights) -> Tensor");
  m.def("moe_expert_sum_gguf(Tensor hidden, Tensor w13q, Tensor w2q, int qtype, "
        "Tensor topk_ids, Tensor topk_weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("moe_expert_sum", &minivllm::moe_expert_sum);
  m.impl("moe_expert_sum_gguf", &minivllm::moe_expert_sum_gguf);
}

TORCH_LIBRARY_IMPL(minivllm, CompositeExplicitAutograd, m) {
  m.impl("moe_expert_sum_available", &minivllm::moe_expert_sum_available);
}
