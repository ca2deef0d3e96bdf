// Punica's BGMV ("batched gather matrix-vector") on the CPU: the LoRA delta of
// a step that mixes adapters, in two calls per wrapped layer for all of them.
//
//   shrink:  y[t]    = lora_a[s(t)] x[t]     x [T, in], lora_a [S, r, in]   -> y [T, r]
//   expand:  out[t] += lora_b[s(t)] y[t]     y [T, r],  lora_b [S, out, r]  (in place)
//
// s(t) is token t's adapter slot (token_slots; -1, the base model, is skipped).
// The reference (minivllm/lora/punica.py) groups the tokens by slot and makes
// one torch product per group: with 4 adapters that is ~8 small calls per
// wrapped layer, ~1,000 per step of a 30-layer model, each costing more in
// dispatch than in arithmetic. Here one call does every group.
//
// The tokens are grouped by slot here too (LoRAGroups), so each adapter's
// factors are read once per call, however many tokens use it: they are the
// delta's memory traffic (a rank-16 adapter on all seven projections of
// SmolLM2-135M is 29 MB of float32, a twentieth of the base weights).
//
// - shrink: a work item is (group, 4 rows of A); the rows stay in L1 while
//   each token of the group is dotted with them.
// - expand: vectorized over outputs, with y[t, j] broadcast, so there is no
//   horizontal sum; that needs B's columns contiguous, so lora_b is read as
//   [S, r, out] storage (the CPU twin, minivllm/cpu/lora.py, allocates its
//   [S, out, r] tensor as the transpose of one; another layout is copied so
//   first). A work item is (group, panel of two vectors of outputs), its
//   tokens four at a time; panels further on are prefetched meanwhile.
// - A fused layer's B is block-diagonal (minivllm/lora/layers.py): module m
//   of M (q, k, v; gate, up) has its output rows and rank columns m r / M to
//   (m + 1) r / M, zeros elsewhere. Given the modules' output sizes
//   (out_slices), the expand reads only the columns of the modules a panel
//   touches: for qkv that skips two thirds of B, for gate_up half. (Adding
//   those zeros would change nothing; reading them is a third of the
//   delta's bytes.)
//
// Arithmetic is float32; bfloat16 and float16 are converted on the way in, and
// y and the delta rounded to the dtype as the reference's products round them.
// Every output value is computed by one thread, in an order that does not
// depend on how the items are shared, so a call gives the same bits whatever
// the split: the decode-step replay (llama_decode.cpp) calls the float32
// slices below from its own threads and matches the layers bit for bit.
#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "cpu_types.h"
#include "ops.h"

namespace minivllm {

LoRAGroups::LoRAGroups(const at::Tensor& token_slots, int64_t num_slots, const char* op) {
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.scalar_type() == at::kLong &&
                  token_slots.device().is_cpu(),
              op, ": token_slots must be a CPU int64 [tokens] tensor, got ",
              token_slots.scalar_type(), " ", token_slots.sizes());
  const at::Tensor slots_of = token_slots.contiguous();
  const int64_t* s = slots_of.data_ptr<int64_t>();
  const int64_t T = slots_of.size(0);
  std::vector<int64_t> count(num_slots, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(s[t] >= -1 && s[t] < num_slots, op, ": token_slots[", t, "] = ", s[t],
                " is not a slot; allowed: -1 (the base model) or 0 to ", num_slots - 1);
    if (s[t] >= 0) ++count[s[t]];
  }
  std::vector<int64_t> next(num_slots, 0);  // where the slot's next token goes
  int64_t total = 0;
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    if (count[slot] == 0) continue;
    slots.push_back(slot);
    starts.push_back(total);
    next[slot] = total;
    total += count[slot];
  }
  starts.push_back(total);
  tokens.resize(total);
  for (int64_t t = 0; t < T; ++t)  // in token order within a group
    if (s[t] >= 0) tokens[next[s[t]]++] = t;
}

namespace {

constexpr int64_t kShrinkRows = 4;  // rows of A per shrink item
constexpr int64_t kTileTokens = 4;  // tokens per expand tile: 8 accumulators
constexpr int64_t kPrefetchPanels = 4;  // how far ahead the expand prefetches B
#ifdef MINIVLLM_VEC
using vec::vf;
constexpr int64_t L = vec::kLanes;
constexpr int64_t kPanel = 2 * L;  // outputs per expand item: two vectors
#else
constexpr int64_t kPanel = 32;
#endif

// y[i] = a[i] . x for the ROWS rows of a (row stride K).
template <int ROWS>
void dot_rows(const float* a, const float* x, int64_t K, float* y) {
#ifdef MINIVLLM_VEC
  vf acc[ROWS];
  for (int i = 0; i < ROWS; ++i) acc[i] = vec::zero();
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    const vf xv = vec::load(x + k);
    for (int i = 0; i < ROWS; ++i) acc[i] = vec::fmadd(vec::load(a + i * K + k), xv, acc[i]);
  }
  if (k < K) {
    const vec::mask tail = vec::first(K - k);
    const vf xv = vec::load(x + k, tail, vec::zero());
    for (int i = 0; i < ROWS; ++i)
      acc[i] = vec::fmadd(vec::load(a + i * K + k, tail, vec::zero()), xv, acc[i]);
  }
  for (int i = 0; i < ROWS; ++i) y[i] = vec::reduce_add(acc[i]);
#else
  for (int i = 0; i < ROWS; ++i) {
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s += a[i * K + k] * x[k];
    y[i] = s;
  }
#endif
}

void dot_rows(int64_t rows, const float* a, const float* x, int64_t K, float* y) {
  switch (rows) {
    case 4: return dot_rows<4>(a, x, K, y);
    case 3: return dot_rows<3>(a, x, K, y);
    case 2: return dot_rows<2>(a, x, K, y);
    default: return dot_rows<1>(a, x, K, y);
  }
}

// `n` values of `src` as float32: src itself for float32, else converted into buf.
template <typename T>
const float* as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = to_float(src[i]);
    return buf;
  }
}

// Shrink items [begin, end): item = (group, kShrinkRows rows of A).
template <typename T>
void shrink_items(const T* x, int64_t ldx, const T* lora_a, int64_t r, int64_t in,
                  const LoRAGroups& g, T* y, int64_t ldy, int64_t begin, int64_t end) {
  const int64_t quads = (r + kShrinkRows - 1) / kShrinkRows;
  std::vector<float> a_buf, x_buf;
  if constexpr (!std::is_same_v<T, float>) {
    a_buf.resize(kShrinkRows * in);
    x_buf.resize(in);
  }
  for (int64_t item = begin; item < end; ++item) {
    const int64_t grp = item / quads, j0 = item % quads * kShrinkRows;
    const int64_t rows = std::min(kShrinkRows, r - j0);
    const float* a = as_float(lora_a + (g.slots[grp] * r + j0) * in, a_buf.data(), rows * in);
    for (int64_t i = g.starts[grp]; i < g.starts[grp + 1]; ++i) {
      const int64_t t = g.tokens[i];
      float out[kShrinkRows];
      dot_rows(rows, a, as_float(x + t * ldx, x_buf.data(), in), in, out);
      for (int64_t k = 0; k < rows; ++k) y[t * ldy + j0 + k] = from_float<T>(out[k]);
    }
  }
}

// out[c] = out[c] + delta[c] for n values, the delta first rounded to T (the
// reference adds a product already in the dtype).
template <typename T>
void add_delta(T* out, const float* delta, int64_t n) {
  for (int64_t c = 0; c < n; ++c)
    out[c] = from_float<T>(to_float(out[c]) + to_float(from_float<T>(delta[c])));
}

#ifdef MINIVLLM_VEC
// TT tokens' outputs of one panel: out[t, :n] += sum_j y[t, j] bt[j, :n], with
// bt's rows ldb apart (n <= kPanel; FULL: n == kPanel, no masks). With
// `prefetch`, the same rows kPrefetchPanels panels on are fetched meanwhile: a
// panel's rows are far apart, more streams than the hardware prefetcher
// follows, and one panel's arithmetic is shorter than a trip to memory.
template <int TT, bool FULL, typename T>
void expand_tile(const float* bt, int64_t ldb, int64_t r, int64_t n, const int64_t* toks,
                 const T* y, int64_t ldy, T* out, int64_t ldo, bool prefetch) {
  vf acc[TT][2];
  for (int i = 0; i < TT; ++i) acc[i][0] = acc[i][1] = vec::zero();
  const vec::mask m0 = vec::first(n), m1 = vec::first(n - L);
  for (int64_t j = 0; j < r; ++j) {
    const float* b = bt + j * ldb;
    if (prefetch) {
      const float* ahead = b + kPrefetchPanels * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      if (kPanel > 16) _mm_prefetch(reinterpret_cast<const char*>(ahead + 16), _MM_HINT_T0);
    }
    const vf b0 = FULL ? vec::load(b) : vec::load(b, m0, vec::zero());
    const vf b1 = FULL ? vec::load(b + L) : vec::load(b + L, m1, vec::zero());
    for (int i = 0; i < TT; ++i) {
      const vf yv = vec::set1(to_float(y[toks[i] * ldy + j]));
      acc[i][0] = vec::fmadd(yv, b0, acc[i][0]);
      acc[i][1] = vec::fmadd(yv, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < TT; ++i) {
    T* o = out + toks[i] * ldo;
    if constexpr (std::is_same_v<T, float>) {
      if (FULL) {
        vec::store(o, vec::add(vec::load(o), acc[i][0]));
        vec::store(o + L, vec::add(vec::load(o + L), acc[i][1]));
      } else {
        vec::store(o, vec::add(vec::load(o, m0, vec::zero()), acc[i][0]), m0);
        vec::store(o + L, vec::add(vec::load(o + L, m1, vec::zero()), acc[i][1]), m1);
      }
    } else {
      alignas(64) float delta[kPanel];
      vec::store(delta, acc[i][0]);
      vec::store(delta + L, acc[i][1]);
      add_delta(o, delta, n);
    }
  }
}

template <bool FULL, typename T>
void expand_tokens(const float* bt, int64_t ldb, int64_t r, int64_t n, const int64_t* toks,
                   int64_t count, const T* y, int64_t ldy, T* out, int64_t ldo, bool prefetch) {
  for (int64_t i = 0; i < count; i += kTileTokens) {
    const bool fetch = prefetch && i == 0;  // once per panel
    switch (std::min(kTileTokens, count - i)) {
      case 4: expand_tile<4, FULL>(bt, ldb, r, n, toks + i, y, ldy, out, ldo, fetch); break;
      case 3: expand_tile<3, FULL>(bt, ldb, r, n, toks + i, y, ldy, out, ldo, fetch); break;
      case 2: expand_tile<2, FULL>(bt, ldb, r, n, toks + i, y, ldy, out, ldo, fetch); break;
      default: expand_tile<1, FULL>(bt, ldb, r, n, toks + i, y, ldy, out, ldo, fetch);
    }
  }
}
#endif

// The module (0 .. M - 1) whose output rows hold row c; slice_ends[m] is the
// end of module m's rows (M = 0: one module).
inline int64_t module_of(int64_t c, const int64_t* slice_ends, int64_t M) {
  int64_t m = 0;
  while (m + 1 < M && c >= slice_ends[m]) ++m;
  return m;
}

// Expand items [begin, end): item = (group, panel of kPanel outputs); lora_bt
// is B as [S, r, out] storage, block-diagonal over the M modules ending at
// slice_ends (M = 0: one module, all of B).
template <typename T>
void expand_items(const T* y, int64_t ldy, const T* lora_bt, int64_t r, int64_t out_features,
                  const int64_t* slice_ends, int64_t M, const LoRAGroups& g, T* out,
                  int64_t ldo, int64_t begin, int64_t end) {
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  const int64_t rank_of_module = r / std::max<int64_t>(M, 1);
  std::vector<float> b_buf;  // a panel of B as float32 [r, kPanel], for other dtypes
  if constexpr (!std::is_same_v<T, float>) b_buf.resize(r * kPanel);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t grp = item / panels, c0 = item % panels * kPanel;
    const int64_t n = std::min(kPanel, out_features - c0);
    // The rank columns of the modules this panel's rows belong to.
    const int64_t j0 = module_of(c0, slice_ends, M) * rank_of_module;
    const int64_t rj = (module_of(c0 + n - 1, slice_ends, M) + 1) * rank_of_module - j0;
    const T* b = lora_bt + (g.slots[grp] * r + j0) * out_features + c0;
    const T* yj = y + j0;
    const float* bt;
    int64_t ldb;
    if constexpr (std::is_same_v<T, float>) {
      bt = b, ldb = out_features;
    } else {
      for (int64_t j = 0; j < rj; ++j)
        for (int64_t c = 0; c < kPanel; ++c)
          b_buf[j * kPanel + c] = c < n ? to_float(b[j * out_features + c]) : 0.f;
      bt = b_buf.data(), ldb = kPanel;
    }
    const int64_t* toks = g.tokens.data() + g.starts[grp];
    const int64_t count = g.starts[grp + 1] - g.starts[grp];
    T* o = out + c0;
#ifdef MINIVLLM_VEC
    const bool prefetch = std::is_same_v<T, float> && c0 + kPrefetchPanels * kPanel < out_features;
    if (n == kPanel) expand_tokens<true>(bt, ldb, rj, n, toks, count, yj, ldy, o, ldo, prefetch);
    else expand_tokens<false>(bt, ldb, rj, n, toks, count, yj, ldy, o, ldo, prefetch);
#else
    for (int64_t i = 0; i < count; ++i) {
      float delta[kPanel] = {};
      for (int64_t j = 0; j < rj; ++j) {
        const float yv = to_float(yj[toks[i] * ldy + j]);
        for (int64_t c = 0; c < n; ++c) delta[c] += yv * bt[j * ldb + c];
      }
      add_delta(o + toks[i] * ldo, delta, n);
    }
#endif
  }
}

void check_dtype(const at::Tensor& t, const char* op, const char* name) {
  const auto d = t.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf, op, ": ", name,
              " has dtype ", d, "; allowed: float32, bfloat16, float16");
}

#define MINIVLLM_DISPATCH_LORA(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

}  // namespace

int64_t slice::bgmv_shrink_items(const LoRAGroups& g, int64_t r) {
  return g.size() * ((r + kShrinkRows - 1) / kShrinkRows);
}

int64_t slice::bgmv_expand_items(const LoRAGroups& g, int64_t out_features) {
  return g.size() * ((out_features + kPanel - 1) / kPanel);
}

void slice::bgmv_shrink(const float* x, int64_t ldx, const float* lora_a, int64_t r, int64_t in,
                        const LoRAGroups& g, float* y, int64_t ldy, int64_t begin, int64_t end) {
  shrink_items<float>(x, ldx, lora_a, r, in, g, y, ldy, begin, end);
}

void slice::bgmv_expand(const float* y, int64_t ldy, const float* lora_bt, int64_t r,
                        int64_t out_features, const int64_t* slice_ends, int64_t num_slices,
                        const LoRAGroups& g, float* out, int64_t ldo, int64_t begin,
                        int64_t end) {
  expand_items<float>(y, ldy, lora_bt, r, out_features, slice_ends, num_slices, g, out, ldo,
                      begin, end);
}

std::vector<int64_t> slice::lora_slice_ends(at::IntArrayRef out_slices, int64_t out_features,
                                            int64_t r, const char* op) {
  std::vector<int64_t> ends;
  int64_t end = 0;
  for (const int64_t size : out_slices) {
    TORCH_CHECK(size > 0, op, ": out_slices ", out_slices, " must be positive sizes");
    ends.push_back(end += size);
  }
  TORCH_CHECK(out_slices.empty() || (end == out_features && r % out_slices.size() == 0), op,
              ": out_slices ", out_slices, " must sum to the ", out_features,
              " outputs, one per module, and the rank ", r, " be a multiple of their number");
  return ends;
}

// x [T, in] (rows contiguous), lora_a [S, r, in], token_slots [T] int64 ->
// y [T, r] (zero rows for base-model tokens), in x's dtype.
at::Tensor bgmv_shrink(at::Tensor x, at::Tensor lora_a, at::Tensor token_slots) {
  check_cpu(x, "bgmv_shrink", "x");
  check_cpu(lora_a, "bgmv_shrink", "lora_a");
  check_dtype(x, "bgmv_shrink", "x");
  TORCH_CHECK(lora_a.dim() == 3, "bgmv_shrink: lora_a must be [slots, rank, in], got ",
              lora_a.sizes());
  const int64_t S = lora_a.size(0), r = lora_a.size(1), in = lora_a.size(2);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in && x.scalar_type() == lora_a.scalar_type(),
              "bgmv_shrink: x must be [tokens, ", in, "] in lora_a's dtype ",
              lora_a.scalar_type(), ", got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.size(0) == x.size(0),
              "bgmv_shrink: token_slots must be [", x.size(0), "] (one slot per row of x), got ",
              token_slots.sizes());
  const LoRAGroups groups(token_slots, S, "bgmv_shrink");
  if (x.stride(1) != 1) x = x.contiguous();
  lora_a = lora_a.contiguous();
  auto y = at::zeros({x.size(0), r}, x.options());
  MINIVLLM_DISPATCH_LORA(x.scalar_type(), "bgmv_shrink", [&] {
    at::parallel_for(0, slice::bgmv_shrink_items(groups, r), 1, [&](int64_t b, int64_t e) {
      shrink_items<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), lora_a.data_ptr<scalar_t>(), r,
                             in, groups, y.data_ptr<scalar_t>(), r, b, e);
    });
  });
  return y;
}

// out [T, o] += each token's lora_b[slot] y[t], in place (base-model tokens
// untouched). lora_b [S, o, r] is read fastest as the transpose of an [S, r, o]
// tensor; any other layout is first copied so. out_slices: the output sizes of
// a fused layer's modules, whose B is block-diagonal (empty: read all of B).
void bgmv_expand_(at::Tensor out, at::Tensor y, at::Tensor lora_b, at::Tensor token_slots,
                  at::IntArrayRef out_slices) {
  check_cpu(out, "bgmv_expand_", "out");
  check_cpu(lora_b, "bgmv_expand_", "lora_b");
  check_dtype(out, "bgmv_expand_", "out");
  TORCH_CHECK(lora_b.dim() == 3, "bgmv_expand_: lora_b must be [slots, out, rank], got ",
              lora_b.sizes());
  const int64_t S = lora_b.size(0), o = lora_b.size(1), r = lora_b.size(2);
  TORCH_CHECK(out.dim() == 2 && out.size(1) == o && out.stride(1) == 1 &&
                  out.scalar_type() == lora_b.scalar_type(),
              "bgmv_expand_: out must be [tokens, ", o, "] with contiguous rows in lora_b's "
              "dtype ", lora_b.scalar_type(), ", got ", out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(y.dim() == 2 && y.size(0) == out.size(0) && y.size(1) == r &&
                  y.scalar_type() == out.scalar_type(),
              "bgmv_expand_: y must be [", out.size(0), ", ", r, "] in out's dtype, got ",
              y.scalar_type(), " ", y.sizes());
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.size(0) == out.size(0),
              "bgmv_expand_: token_slots must be [", out.size(0),
              "] (one slot per row of out), got ", token_slots.sizes());
  const LoRAGroups groups(token_slots, S, "bgmv_expand_");
  const std::vector<int64_t> ends = slice::lora_slice_ends(out_slices, o, r, "bgmv_expand_");
  at::Tensor bt = lora_b.transpose(1, 2);  // [S, r, o]
  if (!bt.is_contiguous()) bt = bt.contiguous();
  y = y.contiguous();
  MINIVLLM_DISPATCH_LORA(out.scalar_type(), "bgmv_expand_", [&] {
    at::parallel_for(0, slice::bgmv_expand_items(groups, o), 1, [&](int64_t b, int64_t e) {
      expand_items<scalar_t>(y.data_ptr<scalar_t>(), r, bt.data_ptr<scalar_t>(), r, o,
                             ends.data(), static_cast<int64_t>(ends.size()), groups,
                             out.data_ptr<scalar_t>(), out.stride(0), b, e);
    });
  });
}

}  // namespace minivllm

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("bgmv_shrink(Tensor x, Tensor lora_a, Tensor token_slots) -> Tensor");
  m.def("bgmv_expand_(Tensor(a!) out, Tensor y, Tensor lora_b, Tensor token_slots, "
        "int[] out_slices=[]) -> ()");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("bgmv_shrink", &minivllm::bgmv_shrink);
  m.impl("bgmv_expand_", &minivllm::bgmv_expand_);
}
