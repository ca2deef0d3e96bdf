// Absorbed MLA decode (DeepSeek-V2/V3's latent attention) on a CPU: one new
// query per sequence over its cached latent rows, read in place through the
// block table.
//
//   out[b, h] = softmax(scale * q[b, h] . R_b^T) R_b[:, :C],   R_b = the first
//   seq_lens[b] rows [c, k_pe] of sequence b (row p in block table[p / bs]),
//   q[b, h] = [W_UK[h]^T q_nope[h], q_pe[h]]   (cpu/mla.py folds W_UK in)
//
// This is multi-query attention with a single KV "head" D = C + R wide (288
// for a latent of 256 and a rope key of 32): every query head reads the same
// rows. So per span of rows the scores are a small matrix product
// Q [H x D] . K [n x D]^T and the output one more, P [H x n] . V [n x C] (V:
// each row's first C columns). Both are tiled in registers, each tile loading
// a row's vector once for several heads and a head's vector once for several
// rows; paged_attention.cpp's grouped-heads kernel, which keeps one 288-wide
// accumulator per head in memory and updates it per key, did neither.
// float32 caches with C a multiple of the vector width take this kernel;
// anything else goes to paged_decode_attention (the same result).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_types.h"
#include "online_softmax.h"
#include "ops.h"

namespace minivllm {
namespace {

#ifdef MINIVLLM_VEC
using vec::vf;
constexpr int64_t L = vec::kLanes;
// Rows scored, then added up, at a time: their V columns (C floats each) stay
// in L2 between the score pass and the value pass's visits. (64 rows took
// 6 % less time than 128 on a 288-wide row, 8 heads, AVX2; 32 about as 64.)
constexpr int64_t kSpan = 64;
// Score tile: kRows rows x 2 heads = L accumulators, summed across lanes by
// one transpose (lane t: head 0's score of row t; lane kRows + t: head 1's).
constexpr int64_t kRows = L / 2;
// Value tile: kHeads heads x kCols vectors of columns (8 of AVX2's 16
// registers, 16 of AVX-512's 32; the rest hold the row's vectors and a score).
constexpr int64_t kHeads = 4;
constexpr int64_t kCols = vec::kRegisters == 32 ? 4 : 2;

// scores[h * kSpan + t] = q[h] . rows[t] for the span's n rows; heads in pairs
// (hp even), d columns (the last vector masked when d is not a multiple of L).
void score_rows(const float* q, int64_t hp, int64_t d, const float* const* rows, int64_t n,
                float* scores) {
  const int64_t full = d / L * L;
  const vec::mask tail = vec::first(d - full);
  for (int64_t t0 = 0; t0 < n; t0 += kRows) {
    const float* k[kRows];
    for (int64_t t = 0; t < kRows; ++t) k[t] = rows[std::min(t0 + t, n - 1)];  // past n: unread
    for (int64_t h = 0; h < hp; h += 2) {
      const float *q0 = q + h * d, *q1 = q0 + d;
      vf acc[L];
      for (int64_t i = 0; i < L; ++i) acc[i] = vec::zero();
      auto step = [&](vf a0, vf a1, auto load_row) {
#pragma GCC unroll 8
        for (int64_t t = 0; t < kRows; ++t) {
          const vf x = load_row(k[t]);
          acc[t] = vec::fmadd(a0, x, acc[t]);
          acc[kRows + t] = vec::fmadd(a1, x, acc[kRows + t]);
        }
      };
      for (int64_t i = 0; i < full; i += L)
        step(vec::load(q0 + i), vec::load(q1 + i), [i](const float* r) { return vec::load(r + i); });
      if (full < d)
        step(vec::load(q0 + full, tail, vec::zero()), vec::load(q1 + full, tail, vec::zero()),
             [full, tail](const float* r) { return vec::load(r + full, tail, vec::zero()); });
      vec::transpose(acc);  // lane j of the sum: the sum of acc[j]'s lanes
      vf s = acc[0];
      for (int64_t i = 1; i < L; ++i) s = vec::add(s, acc[i]);
      alignas(64) float lanes[L];
      vec::store(lanes, s);
      std::memcpy(scores + h * kSpan + t0, lanes, kRows * sizeof(float));
      std::memcpy(scores + (h + 1) * kSpan + t0, lanes + kRows, kRows * sizeof(float));
    }
  }
}

// acc[h][c0 .. c0 + B * L) += sum_t p[h][t] rows[t][c0 ..], for kHeads heads
// from h0; each accumulator scaled by its head's correction first.
template <int B>
inline void add_values(float* acc, int64_t c, int64_t h0, int64_t c0, const float* corr,
                       const float* const* rows, int64_t n, const float* scores) {
  vf a[kHeads][B];
  for (int64_t h = 0; h < kHeads; ++h) {
    const vf k = vec::set1(corr[h0 + h]);
    for (int i = 0; i < B; ++i) a[h][i] = vec::mul(vec::load(acc + (h0 + h) * c + c0 + L * i), k);
  }
  for (int64_t t = 0; t < n; ++t) {
    vf x[B];
    for (int i = 0; i < B; ++i) x[i] = vec::load(rows[t] + c0 + L * i);
#pragma GCC unroll 4
    for (int64_t h = 0; h < kHeads; ++h) {
      const vf p = vec::set1(scores[(h0 + h) * kSpan + t]);
      for (int i = 0; i < B; ++i) a[h][i] = vec::fmadd(p, x[i], a[h][i]);
    }
  }
  for (int64_t h = 0; h < kHeads; ++h)
    for (int i = 0; i < B; ++i) vec::store(acc + (h0 + h) * c + c0 + L * i, a[h][i]);
}

// One sequence: q [hp][d] scaled (heads past the real ones zero), its rows
// [0, len) through `table`; out [heads][c].
void attend_latents(const float* q, int64_t heads, int64_t hp, int64_t d, int64_t c,
                    const float* cache, const int32_t* table, int64_t len, int64_t block_size,
                    float* out) {
  std::vector<float> acc(hp * c, 0.f), scores(hp * kSpan), corr(hp);
  std::vector<float> m(hp, -std::numeric_limits<float>::infinity()), l(hp, 0.f);
  const float* rows[kSpan];
  for (int64_t p = 0; p < len; p += kSpan) {
    const int64_t n = std::min(kSpan, len - p);
    for (int64_t t = 0; t < n; ++t)
      rows[t] = cache + (table[(p + t) / block_size] * block_size + (p + t) % block_size) * d;
    score_rows(q, hp, d, rows, n, scores.data());
    for (int64_t h = 0; h < hp; ++h) corr[h] = softmax_block(scores.data() + h * kSpan, n, m[h], l[h]);
    // A block of columns for every head tile in turn: the rows' cache lines of
    // those columns are read from memory once and from L1 after.
    int64_t c0 = 0;
    for (; c0 + kCols * L <= c; c0 += kCols * L)
      for (int64_t h0 = 0; h0 < hp; h0 += kHeads)
        add_values<kCols>(acc.data(), c, h0, c0, corr.data(), rows, n, scores.data());
    for (; c0 < c; c0 += L)
      for (int64_t h0 = 0; h0 < hp; h0 += kHeads)
        add_values<1>(acc.data(), c, h0, c0, corr.data(), rows, n, scores.data());
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.f / l[h];
    for (int64_t i = 0; i < c; ++i) out[h * c + i] = acc[h * c + i] * inv;
  }
}
#endif

}  // namespace

// q [B, H, D] (D = C + R); cache [num_blocks, block_size, D]; block_tables
// [B, W] and seq_lens [B] int32. Returns [B, H, C]: each head's softmax-
// weighted sum of its sequence's latents (W_UV not applied).
at::Tensor mla_decode_attention(at::Tensor q, at::Tensor cache, at::Tensor block_tables,
                                at::Tensor seq_lens, int64_t kv_lora_rank, double scale) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 3 && q.size(2) == cache.size(2),
              "mla_decode_attention: q must be [B, H, D] and the cache [num_blocks, "
              "block_size, D], got ", q.sizes(), " and ", cache.sizes());
  TORCH_CHECK(kv_lora_rank >= 1 && kv_lora_rank <= q.size(2),
              "mla_decode_attention: kv_lora_rank ", kv_lora_rank, " is not allowed; allowed: 1 to ",
              q.size(2));
  bool tiled = false;
#ifdef MINIVLLM_VEC
  tiled = q.scalar_type() == at::kFloat && cache.scalar_type() == at::kFloat &&
          kv_lora_rank % L == 0;
#endif
  if (!tiled) {  // the grouped-heads kernel, the latent rows as keys and values
    const at::Tensor rows = cache.unsqueeze(2);
    return paged_decode_attention(q, rows, rows, block_tables, seq_lens, scale)
        .narrow(2, 0, kv_lora_rank);
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "mla_decode_attention: block_tables and seq_lens must be int32");
  q = q.contiguous();
  cache = cache.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  check_block_tables(block_tables, seq_lens, q.size(0), cache.size(0), cache.size(1));
  const int64_t seqs = q.size(0), heads = q.size(1), d = q.size(2), c = kv_lora_rank;
  auto out = at::empty({seqs, heads, c}, q.options());
#ifdef MINIVLLM_VEC
  const int64_t hp = (heads + kHeads - 1) / kHeads * kHeads;  // whole tiles; extra heads zero
  const float *qd = q.data_ptr<float>(), *cd = cache.data_ptr<float>();
  const int32_t *tables = block_tables.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  float* od = out.data_ptr<float>();
  const int64_t width = block_tables.size(1), block_size = cache.size(1);
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(hp * d, 0.f);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t x = 0; x < heads * d; ++x) qs[x] = qd[b * heads * d + x] * static_cast<float>(scale);
      attend_latents(qs.data(), heads, hp, d, c, cd, tables + b * width, lens[b], block_size,
                     od + b * heads * c);
    }
  });
#endif
  return out;
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("mla_decode_attention(Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, "
        "int kv_lora_rank, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("mla_decode_attention", &minivllm::mla_decode_attention);
}
