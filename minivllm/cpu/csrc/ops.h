// The kernels' tensor-level entry points, for C++ callers (llama_decode.cpp
// runs a whole decode step through them without going back to Python).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "cpu_types.h"

namespace minivllm {

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache,
                      at::Tensor sin_cache);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor gelu_tanh_and_mul(at::Tensor x);
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                       at::Tensor value_cache, at::Tensor slot_mapping);
// block_tables [num_seqs, W] and seq_lens [num_seqs], both int32 and contiguous,
// name only blocks of a cache of num_blocks blocks; a clear error if not.
void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_seqs, int64_t num_blocks, int64_t block_size,
                        int64_t sliding_window = 0);
// sliding_window 0: every cached key; else the last sliding_window positions.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  int64_t sliding_window = 0);
// One linear layer's product (llama_decode.cpp), chosen as prepack.linear chooses it;
// w: its 4 tensors (weight, panels, bias, packed copy; or GGUF blocks, -, bias, type id).
at::Tensor linear(const at::Tensor& x, const at::Tensor* w, int64_t panel_max_rows,
                  bool halves = false);
// moe_experts.cpp: a mixture of experts' steps 3-5 (float stacks; Q8_0 blocks).
at::Tensor moe_expert_sum(at::Tensor hidden, at::Tensor w13, at::Tensor w2, at::Tensor topk_ids,
                          at::Tensor topk_weights);
at::Tensor moe_expert_sum_gguf(at::Tensor hidden, at::Tensor w13q, at::Tensor w2q,
                               int64_t qtype, at::Tensor topk_ids, at::Tensor topk_weights);
// moe_decode.cpp: one SparseMoeBlock of a decode step. w: its kTensorsPerMoE
// tensors (fused_decode_moe.py's moe_tensors): the router (a linear layer's 4),
// w13, w2, then the shared expert's gate_up, down and gate (4 each; empty
// tensors without one). config: its kIntsPerMoE ints (layer, top_k,
// renormalize, GGML type id of quantized experts or -1, shared gate_up's
// panels in halves). expert_load [E] int64 gets the step's pairs added.
constexpr int64_t kMoERouter = 0, kMoEW13 = 4, kMoEW2 = 5, kMoESharedGateUp = 6,
                  kMoESharedDown = 10, kMoESharedGate = 14, kTensorsPerMoE = 18, kIntsPerMoE = 5;
void check_moe_layer(const at::Tensor* w, const int64_t* config, const at::Tensor& expert_load,
                     int64_t hidden_size, at::ScalarType dtype);
at::Tensor sparse_moe_block(const at::Tensor& x, const at::Tensor* w, const int64_t* config,
                            at::Tensor expert_load, int64_t panel_max_rows);
// mla_decode.cpp: absorbed MLA decode, q [B, H, C + R] over each sequence's latent rows.
at::Tensor mla_decode_attention(at::Tensor q, at::Tensor cache, at::Tensor block_tables,
                                at::Tensor seq_lens, int64_t kv_lora_rank, double scale);
bool packed_linear_available();
int64_t panel_width();  // slice::panel_width, for the Python side
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, int64_t out_features,
                         c10::optional<at::Tensor> bias, bool halves);
at::Tensor matvec(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);
// The LoRA delta's two products for every adapter of a step (lora.cpp).
at::Tensor bgmv_shrink(at::Tensor x, at::Tensor lora_a, at::Tensor token_slots);
void bgmv_expand_(at::Tensor out, at::Tensor y, at::Tensor lora_b, at::Tensor token_slots,
                  at::IntArrayRef out_slices);

// A step's tokens grouped by LoRA slot, for the BGMV kernels: group g is slot
// slots[g], its tokens tokens[starts[g] .. starts[g + 1]). token_slots [T]
// int64 holds each token's slot, -1 (the base model: in no group) or 0 to
// num_slots - 1 (else an error naming op).
struct LoRAGroups {
  std::vector<int64_t> slots, starts, tokens;
  LoRAGroups(const at::Tensor& token_slots, int64_t num_slots, const char* op);
  int64_t size() const { return static_cast<int64_t>(slots.size()); }
};
// gguf_gemm.cpp: products with GGUF blocks [N, row_bytes] of GGML type qtype.
at::Tensor gguf_linear(at::Tensor x, at::Tensor qweight, int64_t qtype,
                       c10::optional<at::Tensor> bias);
at::Tensor gguf_linear_int8(at::Tensor x, at::Tensor qweight, int64_t qtype,
                            c10::optional<at::Tensor> bias);
bool gguf_int8_vnni();  // built with AVX512-VNNI (else a portable loop, the same numbers)
// Bytes of a row of `cols` weights of GGML type qtype; -1: a type or width the kernels do not take.
int64_t gguf_row_bytes(int64_t qtype, int64_t cols);
at::Tensor gguf_dequantize(at::Tensor qweight, int64_t qtype, int64_t cols);  // float32 [N, cols]

// The float32 kernels over a slice [begin, end) of their work, on raw
// pointers, for a caller that splits a step among its own threads
// (llama_decode.cpp's one parallel region per step). The tensor-level entry
// points above check their arguments and call these; callers of these check
// first, as the kernels themselves check nothing.
namespace slice {
// Rows of x (row stride ldx) normalized into out [rows, n]; with a residual
// [rows, n], each row of x is first added into it and the sum normalized.
void rms_norm(const float* x, int64_t ldx, float* residual, const float* weight, float* out,
              int64_t n, float eps, int64_t begin, int64_t end);
// Tokens of q [T, hq, dim] and k [T, hk, dim] (token strides ldq, ldk) rotated in place.
void rotary_embedding(const int64_t* positions, float* q, int64_t ldq, int64_t hq, float* k,
                      int64_t ldk, int64_t hk, const float* cos_cache, const float* sin_cache,
                      int64_t dim, int64_t begin, int64_t end);
// Tokens' key and value heads (token strides ldk, ldv) copied into their cache slots.
void reshape_and_cache(const float* key, int64_t ldk, const float* value, int64_t ldv,
                       float* key_cache, float* value_cache, const int64_t* slot_mapping,
                       int64_t heads, int64_t dim, int64_t begin, int64_t end);
// Decode attention of work items [begin, end), item i = KV head i % Hkv of sequence
// i / Hkv with its query heads; q [B, H, D] with row stride ldq, out [B, H, D] contiguous.
void paged_decode_attention(const float* q, int64_t ldq, const float* k_cache, const float* v_cache,
                            const int32_t* block_tables, const int32_t* seq_lens, float* out,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t table_width, float scale,
                            int64_t sliding_window, int64_t begin, int64_t end);
// Columns [begin, end) of silu(gate) * up for `rows` rows of x = [gate | up] [rows, 2d].
void silu_and_mul(const float* x, float* out, int64_t rows, int64_t d, int64_t begin,
                  int64_t end);
// The same for gelu_tanh(gate) * up (GeGLU).
void gelu_tanh_and_mul(const float* x, float* out, int64_t rows, int64_t d, int64_t begin,
                       int64_t end);
// Output groups [begin, end) of y [1, N] = x W^T + bias, W row-major [N, K]; a group is
// matvec_group_size outputs.
constexpr int64_t matvec_group_size = 4;
void matvec(const float* x, const float* weight, int64_t K, int64_t N, const float* bias,
            float* y, int64_t begin, int64_t end);
// Panels [begin, end) (panel_width output columns each: two vectors, 32 with
// AVX-512, 16 with AVX2) of y [M, N] = x W^T + bias, W packed by
// pack_linear_weight: kColumns without halves; with them kHalves (y as usual)
// or kHalvesSiluAndMul (y [M, N / 2] = silu(first half) * second half).
#ifdef MINIVLLM_VEC
constexpr int64_t panel_width = 2 * vec::kLanes;
#else
constexpr int64_t panel_width = 32;  // (no panel GEMM in this build)
#endif
enum class PanelLayout { kColumns, kHalves, kHalvesSiluAndMul };
void packed_linear(const float* x, int64_t M, int64_t K, const float* packed, int64_t N,
                   const float* bias, float* y, int64_t begin, int64_t end,
                   PanelLayout layout = PanelLayout::kColumns);
// The LoRA delta (lora.cpp) over work items [begin, end): bgmv_shrink_items
// of y [T, r] (row stride ldy) = A[slot] x per token of a group, lora_a
// [S, r, in] contiguous; bgmv_expand_items of out [T, out_features] (row
// stride ldo) += B[slot] y, lora_bt = B as [S, r, out_features] contiguous,
// block-diagonal over num_slices modules whose output rows end at slice_ends
// (lora_slice_ends of their sizes; 0 slices: one module).
// Rows of tokens in no group are left as they are.
int64_t bgmv_shrink_items(const LoRAGroups& groups, int64_t r);
int64_t bgmv_expand_items(const LoRAGroups& groups, int64_t out_features);
void bgmv_shrink(const float* x, int64_t ldx, const float* lora_a, int64_t r, int64_t in,
                 const LoRAGroups& groups, float* y, int64_t ldy, int64_t begin, int64_t end);
void bgmv_expand(const float* y, int64_t ldy, const float* lora_bt, int64_t r,
                 int64_t out_features, const int64_t* slice_ends, int64_t num_slices,
                 const LoRAGroups& groups, float* out, int64_t ldo, int64_t begin, int64_t end);
std::vector<int64_t> lora_slice_ends(at::IntArrayRef out_slices, int64_t out_features, int64_t r,
                                     const char* op);
// Output units [begin, end) (gguf_unit(M) rows of W each) of y [M, N] (row
// stride ldy) = x [M, K] W^T + bias, W [N, row_bytes] GGUF blocks of GGML type
// qtype; M at most gguf_max_rows (more rows: gguf_linear dequantizes and calls MKL).
constexpr int64_t gguf_tile = 12;
constexpr int64_t gguf_wide_rows = 8;  // from here on: the panel GEMM's kernel, a panel a unit
constexpr int64_t gguf_max_rows = 256;
inline int64_t gguf_unit(int64_t M) { return M >= gguf_wide_rows ? panel_width : gguf_tile; }
void gguf_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                 int64_t qtype, int64_t N, const float* bias, float* y, int64_t ldy,
                 int64_t begin, int64_t end);
// gguf_int8.cpp (activation_dtype="int8"): x rows quantized to int8 blocks of
// 32 for weights of GGML type `type` (Q4_0, Q4_1 or Q8_0: gguf_int8_type),
// then units [begin, end) (gguf_tile output rows each) of y = x W^T + bias.
struct Int8Rows {
  int64_t rows = 0, blocks = 0, chunks = 0, type = -1;
  std::vector<int8_t> qs, q;  // the kernel's layout; plain blocks
  std::vector<int32_t> sums;  // per block: sum of q, d (float16 value), s = d * sum
  std::vector<float> d, s;
  void quantize(const float* x, int64_t M, int64_t K, int64_t qtype);

 private:
  void quantize_block(const float* x, int64_t at);
};
bool gguf_int8_type(int64_t qtype);
void gguf_linear_int8(const Int8Rows& xq, const uint8_t* w, int64_t row_bytes, int64_t N,
                      const float* bias, float* y, int64_t ldy, int64_t begin, int64_t end);
}  // namespace slice

}  // namespace minivllm
