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
// accumulator per head in memory and updates it per key, did neither. (Tuned
// on AVX2, then the score tile and its lane sums for AVX-512; tests:
// tests/test_deepseek_mla.py; timings: lab/bench/hybrid_decode.py --kernels.)
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
// Score tile: kRows rows x kScoreHeads heads = L accumulators, summed across
// lanes at the end (lane j * kRows + t: head j's score of row t). AVX-512
// takes 4 rows x 4 heads: each row vector loaded serves 4 heads, each query
// vector 4 rows (8 rows x 2 heads, AVX2's tile, took 1.1-1.25x the time,
// one thread, 8 heads, 288-wide rows; 2 rows x 8 heads 1.1x).
constexpr int64_t kScoreHeads = vec::kRegisters == 32 ? 4 : 2;
constexpr int64_t kRows = L / kScoreHeads;
// Value tile: kHeads heads x kCols vectors of columns (12 of AVX2's 16
// registers, 16 of AVX-512's 32; the rest hold the row's vectors and a score).
// AVX2's 4 x 3 took 0.95x the time of 4 x 2: more independent FMAs per load.
constexpr int64_t kHeads = 4;
constexpr int64_t kCols = vec::kRegisters == 32 ? 4 : 3;
// Whole tiles of heads for both passes (the extra heads' queries are zero).
constexpr int64_t kHeadTile = std::max(kScoreHeads, kHeads);

// Lane j of the result: the sum of r[j]'s lanes (L vectors). On AVX-512 a
// tree of halvings, each round adding two vectors' halves: 31 shuffles where
// a transpose then a sum took 64, a visible share of the score pass.
inline vf lane_sums(vf* r) {
#ifdef __AVX512F__
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // low 256 bits: r[i]'s partial sums; high: r[i + 8]'s
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[i], r[i + 8], 0x44),
                         _mm512_shuffle_f32x4(r[i], r[i + 8], 0xee));
  for (int i = 0; i < 4; ++i)  // quarters: r[i], r[i + 8], r[i + 4], r[i + 12]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88),
                         _mm512_shuffle_f32x4(a[i], a[i + 4], 0xdd));
  auto pd = [](vf x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 2; ++i)  // per quarter: lane pairs of b[2i], then of b[2i + 1]
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(pd(b[2 * i]), pd(b[2 * i + 1]))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b[2 * i]), pd(b[2 * i + 1]))));
  const vf s = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_shuffle_f32x4(s, s, 0xd8);  // quarters r[0..], r[8..], r[4..], r[12..] in order
#else
  vec::transpose(r);  // lane j of the sum: the sum of r[j]'s lanes
  vf s = r[0];
  for (int64_t i = 1; i < L; ++i) s = vec::add(s, r[i]);
  return s;
#endif
}

// The next span's rows, fetched into L2 a cache line at a time while this
// span is scored. A decode step's rows come from memory (4 layers of 8 x 1,024
// rows are 38 MB, with the weights streamed between them), and the hardware
// prefetchers, which stop at page ends and do not follow the block table, left
// the kernel waiting on them. The lines are spread evenly over the score
// pass's vector steps (`steps` ticks fetch `total` lines): fetched in a burst,
// they filled the core's line fill buffers and stalled the FMAs behind them
// until memory caught up (the spread took 0.8x the burst's time with the
// caches cold, AVX2 and AVX-512 alike).
struct Prefetcher {
  const float* const* rows;
  int64_t lines_per_row, total, steps;
  int64_t row = 0, line = 0, due = 0;
  inline void tick() {
    for (due += total; due >= steps; due -= steps) {  // at most `total` lines in `steps` ticks
      if (line == lines_per_row) line = 0, ++row;
      _mm_prefetch(reinterpret_cast<const char*>(rows[row]) + 64 * line++, _MM_HINT_T1);
    }
  }
};

// scores[h * kSpan + t] = q[h] . rows[t] for the span's n rows; heads in tiles
// of kScoreHeads (hp a multiple), d columns (the last vector masked when d is
// not a multiple of L); meanwhile the next span's next_n rows are prefetched.
void score_rows(const float* q, int64_t hp, int64_t d, const float* const* rows, int64_t n,
                float* scores, const float* const* next, int64_t next_n) {
  const int64_t full = d / L * L;
  const vec::mask tail = vec::first(d - full);
  const int64_t lines = (d * static_cast<int64_t>(sizeof(float)) + 63) / 64;
  const int64_t steps = (n + kRows - 1) / kRows * (hp / kScoreHeads) * (full / L);
  Prefetcher pf{next, lines, steps > 0 ? next_n * lines : 0, std::max<int64_t>(steps, 1)};
  for (int64_t t0 = 0; t0 < n; t0 += kRows) {
    const float* k[kRows];
    for (int64_t t = 0; t < kRows; ++t) k[t] = rows[std::min(t0 + t, n - 1)];  // past n: unread
    for (int64_t h = 0; h < hp; h += kScoreHeads) {
      vf acc[L];
      for (int64_t i = 0; i < L; ++i) acc[i] = vec::zero();
      auto step = [&](const vf* a, auto load_row) {
#pragma GCC unroll 8
        for (int64_t t = 0; t < kRows; ++t) {
          vf x = load_row(k[t]);
          // Held in a register for its kScoreHeads FMAs: left alone, GCC folded
          // the load into each FMA, a load per FMA (0.92x the time so, AVX2).
          asm("" : "+x"(x));
#pragma GCC unroll 4
          for (int64_t j = 0; j < kScoreHeads; ++j)
            acc[j * kRows + t] = vec::fmadd(a[j], x, acc[j * kRows + t]);
        }
      };
      vf a[kScoreHeads];
      for (int64_t i = 0; i < full; i += L) {
        pf.tick();
        for (int64_t j = 0; j < kScoreHeads; ++j) a[j] = vec::load(q + (h + j) * d + i);
        step(a, [i](const float* r) { return vec::load(r + i); });
      }
      if (full < d) {
        for (int64_t j = 0; j < kScoreHeads; ++j)
          a[j] = vec::load(q + (h + j) * d + full, tail, vec::zero());
        step(a, [full, tail](const float* r) { return vec::load(r + full, tail, vec::zero()); });
      }
      alignas(64) float lanes[L];
      vec::store(lanes, lane_sums(acc));
      for (int64_t j = 0; j < kScoreHeads; ++j)
        std::memcpy(scores + (h + j) * kSpan + t0, lanes + j * kRows, kRows * sizeof(float));
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
// [0, len) through `table`; out [heads][c]. Its last span prefetches the first
// of the sequence the thread takes next (next_len rows through next_table).
void attend_latents(const float* q, int64_t heads, int64_t hp, int64_t d, int64_t c,
                    const float* cache, const int32_t* table, int64_t len, int64_t block_size,
                    float* out, const int32_t* next_table, int64_t next_len) {
  std::vector<float> acc(hp * c, 0.f), scores(hp * kSpan), corr(hp);
  std::vector<float> m(hp, -std::numeric_limits<float>::infinity()), l(hp, 0.f);
  // The row pointers of this span and the next (two buffers, in turn).
  const float* spans[2][kSpan];
  auto locate = [&](const int32_t* table, int64_t len, int64_t p, const float** rows) {
    const int64_t n = std::min(kSpan, len - p);
    // Block by block (a division per row cost about 2 % of the kernel).
    const int32_t* block = table + p / block_size;
    for (int64_t t = 0, at = p % block_size; t < n; ++t) {
      rows[t] = cache + (*block * block_size + at) * d;
      if (++at == block_size) at = 0, ++block;
    }
    return n;
  };
  if (len > 0) locate(table, len, 0, spans[0]);
  for (int64_t p = 0, which = 0; p < len; p += kSpan, which ^= 1) {
    const float** rows = spans[which];
    const int64_t n = std::min(kSpan, len - p);
    const int64_t next_n = p + kSpan < len ? locate(table, len, p + kSpan, spans[which ^ 1])
                           : next_len > 0  ? locate(next_table, next_len, 0, spans[which ^ 1])
                                           : 0;
    score_rows(q, hp, d, rows, n, scores.data(), spans[which ^ 1], next_n);
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
  const int64_t hp = (heads + kHeadTile - 1) / kHeadTile * kHeadTile;  // extra heads zero
  const float *qd = q.data_ptr<float>(), *cd = cache.data_ptr<float>();
  const int32_t *tables = block_tables.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  float* od = out.data_ptr<float>();
  const int64_t width = block_tables.size(1), block_size = cache.size(1);
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(hp * d, 0.f);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t x = 0; x < heads * d; ++x) qs[x] = qd[b * heads * d + x] * static_cast<float>(scale);
      attend_latents(qs.data(), heads, hp, d, c, cd, tables + b * width, lens[b], block_size,
                     od + b * heads * c, b + 1 < end ? tables + (b + 1) * width : nullptr,
                     b + 1 < end ? lens[b + 1] : 0);
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
