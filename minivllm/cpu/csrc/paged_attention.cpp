// Paged decode attention for CPUs: one new query token per sequence, its keys
// and values read in place through the block table (never gathered into a
// padded copy, which is what the pure-PyTorch path has to do).
//
//   out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b,   K_b, V_b = the first
//   seq_lens[b] tokens of sequence b, token p in block block_tables[b][p / bs]
//
// One work item per (sequence, KV head): the G = H / Hkv query heads that
// share a KV head are handled together, so each key and value row is loaded
// once for all of them (grouped-query attention). Keys are visited a span of up
// to 256 tokens at a time with the online softmax: a running maximum m, a
// running sum l and an accumulator rescaled whenever m grows, so one pass over
// the context suffices.
// Everything accumulates in float32, whatever the cache dtype.
//
// A sliding window (sliding_window > 0) starts the keys at the window's first
// position, seq_len - sliding_window, instead of 0: the kernel never reads the
// blocks before it, which a sliding layer's block table no longer holds.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_types.h"
#include "ops.h"
#include "online_softmax.h"

namespace minivllm {
namespace {

#ifdef MINIVLLM_VEC
using vec::vf;
constexpr int64_t L = vec::kLanes;
#endif

// Row r of a cache block as float32: the row itself for float32 caches,
// else converted into `buf`.
template <typename T>
inline const float* as_float(const T* row, float* buf, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) buf[i] = to_float(row[i]);
    return buf;
  }
}

inline float dot(const float* a, const float* b, int64_t d) {
#ifdef MINIVLLM_VEC
  // The compiler's own reduction ends in a chain of scalar adds; on a
  // 64-wide head that chain, not the multiplies, would set the pace.
  if (d % L == 0) {
    vf acc = vec::mul(vec::load(a), vec::load(b));
    for (int64_t i = L; i < d; i += L) acc = vec::fmadd(vec::load(a + i), vec::load(b + i), acc);
    return vec::reduce_add(acc);
  }
#endif
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += p * x[i];
}

// Where one work item reads: KV head j of sequence b, and its query heads.
template <typename T>
struct Item {
  const float* q;              // its query heads, scaled, [heads][d]
  int64_t heads, d;
  const T *k_cache, *v_cache;  // offset to KV head j
  const int32_t* table;        // the sequence's block table
  int64_t first, len, block_size, token_stride;  // keys at positions [first, len)
  const T* then_k;  // the next item's first block (at its KV head), or nullptr

  // off[i] = where token p + i's row starts in k_cache and v_cache, i < n.
  void rows(int64_t p, int64_t n, int64_t* off) const {
    for (int64_t i = 0; i < n;) {
      const int64_t slot = p % block_size, m = std::min(block_size - slot, n - i);
      const int64_t first = (table[p / block_size] * block_size + slot) * token_stride;
      for (int64_t r = 0; r < m; ++r) off[i + r] = first + r * token_stride;
      i += m;
      p += m;
    }
  }
};

// The kernels score a span of up to kSpan tokens, then take one online-
// softmax step over all of them, then add up their values. Taken once a
// 16-slot block instead (as an earlier version did), that step's reductions,
// chains of dependent instructions, took a large share of the kernel's time.
constexpr int64_t kSpan = 256;
// Rows read ahead: the kernels prefetch the row kAhead rows further along
// their reading order (below). A block's rows are apart in memory and blocks
// are scattered, so the hardware prefetchers alone leave the loads waiting.
constexpr int64_t kAhead = 32;

// Into L2. (Written as asm: GCC dropped _mm_prefetch from these loops.)
template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64)
    asm volatile("prefetcht1 %0" : : "m"(p[b]));
}

// One span of an item: off[0, n) the rows of its tokens, off[n, n + ahead)
// those of the next span's first tokens. The kernels read this span's keys,
// then its values, then the next span's keys, and so on, then the next
// item's keys: before_key and before_value prefetch kAhead rows along.
template <typename T>
struct Span {
  const Item<T>& it;
  const int64_t* off;
  int64_t n, ahead;

  void before_key(int64_t t) const {
    const int64_t r = t + kAhead;
    if (r < n) prefetch_row(it.k_cache + off[r], it.d);
    else if (r - n < n) prefetch_row(it.v_cache + off[r - n], it.d);
  }
  void before_value(int64_t t) const {
    const int64_t r = t + kAhead - n;  // rows past this span's values
    if (r < 0) prefetch_row(it.v_cache + off[t + kAhead], it.d);
    else if (r < ahead) prefetch_row(it.k_cache + off[n + r], it.d);
    else if (it.then_k != nullptr && r - ahead < it.block_size)
      prefetch_row(it.then_k + (r - ahead) * it.token_stride, it.d);
  }
};

// Calls fn(span) for the item's tokens, kSpan at a time.
template <typename T, typename Fn>
inline void for_each_span(const Item<T>& it, Fn&& fn) {
  int64_t off[kSpan + kAhead];
  for (int64_t p = it.first; p < it.len; p += kSpan) {
    const int64_t n = std::min(kSpan, it.len - p), ahead = std::min(kAhead, it.len - p - n);
    it.rows(p, n + ahead, off);
    fn(Span<T>{it, off, n, ahead});
  }
}

#ifdef MINIVLLM_VEC
// r[t] = the sum of v[t]'s lanes, for t = 0 .. L - 1: a transpose folded into
// the additions, where one horizontal sum at a time takes a chain of
// dependent instructions each.
#ifdef __AVX512F__
inline vf sum_lanes(const vf* v) {  // 16 x 16: 30 shuffles and 15 additions
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // within each 128-bit lane, pairs of vectors
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // lane L of b[i]: lane L's sums of v[4i .. 4i+3]
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Then across the four lanes: lane i of the result sums b[i]'s lanes.
  auto fold = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return fold(fold(b[0], b[1]), fold(b[2], b[3]));
}
#else
inline vf sum_lanes(const vf* v) {  // 8 x 8: pairwise adds within 128-bit halves, then across
  auto pairs = [](__m256 x, __m256 y) { return _mm256_hadd_ps(x, y); };
  // Half h of q0: the sums of v[0..3]'s lanes 4h .. 4h + 3; of q1, v[4..7]'s.
  const __m256 q0 = pairs(pairs(v[0], v[1]), pairs(v[2], v[3]));
  const __m256 q1 = pairs(pairs(v[4], v[5]), pairs(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}
#endif

// Accumulator vectors the value pass keeps in registers: half the AVX-512
// register file, or 12 of AVX2's 16 (the rest hold the broadcast scores).
constexpr int kAccumulators = vec::kRegisters == 32 ? 16 : 12;

// Vectors of each head's accumulator the value pass takes at a time: all V
// when the g heads' accumulators fit in kAccumulators, else the largest
// divisor of V that fits (the pass then goes over the span's values once per
// block of columns, each time reading other cache lines of the rows).
constexpr int value_block(int g, int v) {
  int b = v;
  while (b > 1 && (v % b != 0 || g * b > kAccumulators)) --b;
  return b;
}

// kD a multiple of L and exactly kG query heads, both known at compile time,
// so the accumulators stay in registers through each span (all of them on
// AVX-512: heads_per_chunk keeps kG * kD / 16 <= 16; a block of columns at a
// time on AVX2). Scores are finished L tokens at a time by sum_lanes.
template <typename T, int kD, int kG>
void attend_in_registers(const Item<T>& it, T* out) {
  constexpr int V = kD / L, B = value_block(kG, V);
  alignas(64) float acc[kG][kD];
  float m[kG], l[kG];
  alignas(64) float scores[kG][kSpan];
  for (int h = 0; h < kG; ++h) {
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.f;
    for (int i = 0; i < kD; ++i) acc[h][i] = 0.f;
  }
  for_each_span(it, [&](const Span<T>& span) {
    const int64_t n = span.n;
    for (int64_t t0 = 0; t0 < n; t0 += L) {
      vf part[kG][L];
      for (int64_t t = 0; t < L; ++t) {
        if (t0 + t >= n) {  // past the span: scores that are never read
          for (int h = 0; h < kG; ++h) part[h][t] = vec::zero();
          continue;
        }
        span.before_key(t0 + t);
        const T* key = it.k_cache + span.off[t0 + t];
        vf k[V];  // the key as float32, converted once for the kG heads
        for (int i = 0; i < V; ++i) k[i] = vec::load(key + L * i);
        for (int h = 0; h < kG; ++h) {
          const float* q = it.q + h * kD;
          vf s = vec::mul(vec::load(q), k[0]);
          for (int i = 1; i < V; ++i) s = vec::fmadd(vec::load(q + L * i), k[i], s);
          part[h][t] = s;
        }
      }
      for (int h = 0; h < kG; ++h) vec::store(scores[h] + t0, sum_lanes(part[h]));
    }
    for (int h = 0; h < kG; ++h) {
      const vf c = vec::set1(softmax_block(scores[h], n, m[h], l[h]));
      for (int i = 0; i < V; ++i) vec::store(acc[h] + L * i, vec::mul(vec::load(acc[h] + L * i), c));
    }
    for (int i0 = 0; i0 < V; i0 += B) {
      vf a[kG][B];
      for (int h = 0; h < kG; ++h)
        for (int i = 0; i < B; ++i) a[h][i] = vec::load(acc[h] + L * (i0 + i));
      for (int64_t t = 0; t < n; ++t) {
        if (i0 == 0) span.before_value(t);
        const T* v = it.v_cache + span.off[t] + L * i0;
#pragma GCC unroll 16
        for (int i = 0; i < B; ++i) {
          const vf x = vec::load(v + L * i);
#pragma GCC unroll 8
          for (int h = 0; h < kG; ++h) a[h][i] = vec::fmadd(vec::set1(scores[h][t]), x, a[h][i]);
        }
      }
      for (int h = 0; h < kG; ++h)
        for (int i = 0; i < B; ++i) vec::store(acc[h] + L * (i0 + i), a[h][i]);
    }
  });
  for (int h = 0; h < kG; ++h) {
    const float inv = 1.f / l[h];
    for (int i = 0; i < kD; ++i) out[h * kD + i] = from_float<T>(acc[h][i] * inv);
  }
}

// attend_in_registers for it.heads (1 to kG) heads.
template <typename T, int kD, int kG>
void attend_heads(const Item<T>& it, T* out) {
  if constexpr (kG > 1)
    if (it.heads < kG) return attend_heads<T, kD, kG - 1>(it, out);
  attend_in_registers<T, kD, kG>(it, out);
}
#endif

// Any head size and head count: the accumulators in memory.
template <typename T>
void attend_in_memory(const Item<T>& it, T* out) {
  const int64_t heads = it.heads, d = it.d;
  std::vector<float> acc(heads * d, 0.f), buf(d), scores(heads * kSpan);
  std::vector<float> m(heads, -std::numeric_limits<float>::infinity()), l(heads, 0.f);
  for_each_span(it, [&](const Span<T>& span) {
    for (int64_t t = 0; t < span.n; ++t) {
      span.before_key(t);
      const float* k = as_float(it.k_cache + span.off[t], buf.data(), d);
      for (int64_t h = 0; h < heads; ++h) scores[h * kSpan + t] = dot(it.q + h * d, k, d);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float c = softmax_block(scores.data() + h * kSpan, span.n, m[h], l[h]);
      for (int64_t i = 0; i < d; ++i) acc[h * d + i] *= c;
    }
    for (int64_t t = 0; t < span.n; ++t) {
      span.before_value(t);
      const float* v = as_float(it.v_cache + span.off[t], buf.data(), d);
      for (int64_t h = 0; h < heads; ++h) axpy(scores[h * kSpan + t], v, acc.data() + h * d, d);
    }
  });
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.f / l[h];
    for (int64_t i = 0; i < d; ++i) out[h * d + i] = from_float<T>(acc[h * d + i] * inv);
  }
}

// The register kernel covers the 16- and 32-bit caches and the common head
// sizes; double caches (tests only) and other sizes take the memory kernel.
template <typename T>
constexpr bool kRegisterKernel = !std::is_same_v<T, double>;

// Query heads the kernels take at once for head size d: as many as the
// register kernel's accumulators fit in 16 AVX-512 vectors (256 floats; AVX2
// takes as many, a block of columns at a time), else all.
template <typename T>
int64_t heads_per_chunk(int64_t d) {
#ifdef MINIVLLM_VEC
  if (kRegisterKernel<T> && (d == 32 || d == 64 || d == 128)) return 256 / d;
#endif
  return std::numeric_limits<int64_t>::max();
}

template <typename T>
void attend_chunk(const Item<T>& it, T* out) {
#ifdef MINIVLLM_VEC
  if constexpr (kRegisterKernel<T>) {
    switch (it.d) {
      case 32: return attend_heads<T, 32, 8>(it, out);
      case 64: return attend_heads<T, 64, 4>(it, out);
      case 128: return attend_heads<T, 128, 2>(it, out);
    }
  }
#endif
  attend_in_memory(it, out);
}

// The first key position sequence b's query sees: 0, or its window's first.
inline int64_t first_key(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// Work items [begin, end): item i is KV head i % Hkv of sequence i / Hkv and
// the G = H / Hkv query heads that read it (grouped-query attention: each key
// and value row is loaded once for all of them). A sequence's items read
// disjoint cache lines, so splitting by KV head adds no traffic, and a single
// sequence still has Hkv items to share among the threads.
template <typename T>
void attend_items(const T* q, int64_t ldq, const T* k_cache, const T* v_cache,
                  const int32_t* block_tables, const int32_t* seq_lens, T* out,
                  int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t block_size,
                  int64_t table_width, float scale, int64_t window, int64_t begin,
                  int64_t end) {
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * d;
  const int64_t chunk = std::min(group, heads_per_chunk<T>(d));
  // The scaled queries; on the stack for common sizes (the fused decode loop
  // calls this per item, 30 layers x sequences x KV heads a step).
  float stack[1024];
  std::vector<float> heap(group * d > 1024 ? group * d : 0);
  float* qs = heap.empty() ? stack : heap.data();
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / num_kv_heads, j = i % num_kv_heads;
    const T* qb = q + b * ldq + j * group * d;
    for (int64_t x = 0; x < group * d; ++x) qs[x] = to_float(qb[x]) * scale;
    // Where the next item of this range starts reading, to prefetch it.
    const T* then_k = nullptr;
    if (i + 1 < end) {
      const int64_t nb = (i + 1) / num_kv_heads, nj = (i + 1) % num_kv_heads;
      const int64_t first_block = first_key(seq_lens[nb], window) / block_size;
      then_k = k_cache +
               block_tables[nb * table_width + first_block] * block_size * token_stride + nj * d;
    }
    for (int64_t h0 = 0; h0 < group; h0 += chunk) {
      const bool last = h0 + chunk >= group;  // earlier chunks: the same item follows
      const Item<T> it{qs + h0 * d, std::min(chunk, group - h0), d, k_cache + j * d,
                       v_cache + j * d, block_tables + b * table_width,
                       first_key(seq_lens[b], window), seq_lens[b], block_size, token_stride,
                       last ? then_k : nullptr};
      attend_chunk(it, out + (b * num_heads + j * group + h0) * d);
    }
  }
}

constexpr int64_t kMaxBlockSize = 128;  // CacheConfig allows block sizes up to 128

}  // namespace

// Every block a sequence reads must be in its table and in the cache: the
// kernel follows the table without bounds checks of its own. (With a sliding
// window it reads only the window's blocks; the table's earlier entries may be -1.)
void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_seqs, int64_t num_blocks, int64_t block_size,
                        int64_t sliding_window) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs,
              "paged_decode_attention: block_tables must be [", num_seqs,
              ", W] and seq_lens [", num_seqs, "], got ", block_tables.sizes(), " and ",
              seq_lens.sizes());
  TORCH_CHECK(block_size >= 1 && block_size <= kMaxBlockSize,
              "paged_decode_attention: block_size ", block_size, " is not allowed; allowed: 1 to ",
              kMaxBlockSize);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t used = (lens[b] + block_size - 1) / block_size;
    TORCH_CHECK(lens[b] >= 1 && used <= width, "paged_decode_attention: seq_lens[", b, "] = ",
                lens[b], " needs ", used, " blocks; allowed: 1 to ", width * block_size,
                " tokens (", width, " table entries of ", block_size, ")");
    for (int64_t i = first_key(lens[b], sliding_window) / block_size; i < used; ++i) {
      const int32_t block = tables[b * width + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block_tables[",
                  b, "][", i, "] = ", block, " is not a block of the cache (0 to ",
                  num_blocks - 1, ")");
    }
  }
}

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables
// [B, W] int32; seq_lens [B] int32 (each >= 1); sliding_window 0 (none) or the
// positions a query sees, itself included. Returns [B, H, D]. (v_cache may be
// k_cache itself: MLA's latent rows are both, cpu/mla.py.)
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache,
                                     at::Tensor v_cache, at::Tensor block_tables,
                                     at::Tensor seq_lens, double scale,
                                     int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q must be [B, H, D] and the caches "
              "[num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and seq_lens must be int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3),
              "paged_decode_attention: heads or head_dim do not match the cache");
  TORCH_CHECK(sliding_window >= 0, "paged_decode_attention: sliding_window ", sliding_window,
              " is not allowed; allowed: 0 (none) or a window of >= 1 positions");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  check_block_tables(block_tables, seq_lens, q.size(0), k_cache.size(0), k_cache.size(1),
                     sliding_window);
  auto out = at::empty_like(q);
  MINIVLLM_DISPATCH_FLOATS(q.scalar_type(), "paged_decode_attention", [&] {
    at::parallel_for(0, q.size(0) * k_cache.size(2), 1, [&](int64_t b, int64_t e) {
      attend_items<scalar_t>(q.data_ptr<scalar_t>(), q.size(1) * q.size(2),
                             k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                             block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                             out.data_ptr<scalar_t>(), q.size(1), k_cache.size(2), q.size(2),
                             k_cache.size(1), block_tables.size(1), static_cast<float>(scale),
                             sliding_window, b, e);
    });
  });
  return out;
}

void slice::paged_decode_attention(const float* q, int64_t ldq, const float* k_cache,
                                   const float* v_cache, const int32_t* block_tables,
                                   const int32_t* seq_lens, float* out, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                   int64_t table_width, float scale, int64_t sliding_window,
                                   int64_t begin, int64_t end) {
  attend_items<float>(q, ldq, k_cache, v_cache, block_tables, seq_lens, out, num_heads,
                      num_kv_heads, head_dim, block_size, table_width, scale, sliding_window,
                      begin, end);
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int sliding_window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("paged_decode_attention", &minivllm::paged_decode_attention);
}
