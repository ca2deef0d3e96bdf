// A mixture of experts' MLP in the decode-step replay (llama_decode.cpp): one
// SparseMoeBlock of minivllm/model/models/moe.py (Qwen3-MoE, Mixtral, Qwen2-MoE's
// gated shared expert) as the CPU path's Python layers compute it.
//
// Why here and not in the one parallel region: the router's top-k and the
// experts' grouping by expert are a different shape of work from the region's
// column splits (moe_experts.cpp shares out (expert, column block) items
// dynamically). So a float32 step leaves its region for each MoE layer's MLP and
// comes back for the next layer's attention; the step is still one call, without
// Python between its operators.
//
// The operators are the twins' (minivllm/cpu/fused_moe.py, fused_moe.route, the
// layers' packed linears), called on the same tensors in the same order, so the
// step's numbers are the Python layers', bit for bit.
#include <ATen/ATen.h>

#include <string>
#include <tuple>

#include "ops.h"

namespace minivllm {

namespace {

bool absent(const at::Tensor* linear) { return linear[0].numel() == 0; }

}  // namespace

void check_moe_layer(const at::Tensor* w, const int64_t* config, const at::Tensor& expert_load,
                     int64_t hidden_size, at::ScalarType dtype) {
  const std::string what =
      "llama_decode_forward: layer " + std::to_string(config[0]) + "'s experts";
  const at::Tensor &w13 = w[kMoEW13], &w2 = w[kMoEW2];
  const bool quantized = config[3] >= 0;
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) &&
                  (quantized ? w13.scalar_type() == at::kByte : w13.scalar_type() == dtype),
              what, ": w13 and w2 must be stacks [E, ., .] of the hidden states' dtype ", dtype,
              " (or, with a GGML type id, uint8 blocks); got ", w13.scalar_type(), " ",
              w13.sizes(), " and ", w2.sizes());
  const int64_t experts = w13.size(0);
  TORCH_CHECK(config[1] >= 1 && config[1] <= experts, what, ": top_k ", config[1],
              " must be 1 to the ", experts, " experts");
  const at::Tensor& router = w[kMoERouter];  // (its weight: the first of its 4)
  TORCH_CHECK(router.dim() == 2 && router.size(0) == experts && router.size(1) == hidden_size,
              what, ": the router's weight must be [", experts, ", ", hidden_size, "], got ",
              router.sizes());
  TORCH_CHECK(expert_load.scalar_type() == at::kLong && expert_load.dim() == 1 &&
                  expert_load.size(0) == experts,
              what, ": expert_load must be int64 [", experts, "], got ",
              expert_load.scalar_type(), " ", expert_load.sizes());
  TORCH_CHECK(absent(w + kMoESharedGateUp) == absent(w + kMoESharedDown) &&
                  absent(w + kMoESharedGateUp) == absent(w + kMoESharedGate),
              what, ": the shared expert's gate_up, down and gate must be all given or none");
}

// fused_moe.py's FusedMoE.forward (route, the load, the twin's sum_experts) and
// SparseMoeBlock.forward (the shared expert and its sigmoid gate) on the
// post-attention norm's output x [T, H].
at::Tensor sparse_moe_block(const at::Tensor& x, const at::Tensor* w, const int64_t* config,
                            at::Tensor expert_load, int64_t panel_max_rows) {
  const int64_t top_k = config[1], qtype = config[3];
  const bool renormalize = config[2] != 0, shared_halves = config[4] != 0;
  const at::Tensor router_logits = linear(x, w + kMoERouter, panel_max_rows);
  // route(): softmax in float32, each token's top-k, their probabilities
  // (renormalised to sum to 1 where the model says so).
  const at::Tensor scores = at::softmax(router_logits, -1, at::kFloat);
  const at::Tensor ids = std::get<1>(scores.topk(top_k, -1));
  at::Tensor weights = scores.gather(1, ids);
  if (renormalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  expert_load.add_(at::bincount(ids.flatten(), {}, expert_load.size(0)));
  at::Tensor out = qtype < 0 ? moe_expert_sum(x, w[kMoEW13], w[kMoEW2], ids, weights)
                             : moe_expert_sum_gguf(x, w[kMoEW13], w[kMoEW2], qtype, ids, weights);
  if (absent(w + kMoESharedGateUp)) return out;
  // Qwen2-MoE: a dense MLP every token takes, scaled by a sigmoid gate.
  const at::Tensor gate = at::sigmoid(linear(x, w + kMoESharedGate, panel_max_rows));
  const at::Tensor act =
      silu_and_mul(linear(x, w + kMoESharedGateUp, panel_max_rows, shared_halves));
  return out + gate * linear(act, w + kMoESharedDown, panel_max_rows);
}

}  // namespace minivllm
