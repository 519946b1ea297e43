// The two decode steps of one rank (design.md section 2; the seed's HybridStep).
// A replica's step has m = B q rows; G = TP size, t = this rank's TP index,
// c = ceil(m / G); sp_shard gives rank t the rows [t c, (t+1) c), zero-padded
// to c rows (the padding never reaches an expert).
//
// StockStep (sequence parallel), per layer:
//   AttnRes + input norm on the shard -> all_gather (tp) -> attention of the
//   local heads on all m rows -> o_proj partial -> reduce_scatter (tp) -> AttnRes
//   + post-attention norm on the shard -> MoE on the shard (EP exchange over
//   the world) or the dense MLP on the shard.
// HybridStep, per layer:
//   AttnRes + input norm on all rows -> attention of the local heads on all rows
//   -> o_proj partial -> all_reduce (tp) -> AttnRes + post-attention norm on all
//   rows -> MoE: run_stock_moe (sp_shard, the same MoE module, sp_all_gather, trim)
//   or run_dense on all rows (replicated weights, no collective).
// Both end with the final AttnRes, the norm and the vocab-parallel lm_head
// (its slices all-gathered over tp), so every rank of the replica returns
// the same logits [m, V]. Aux hidden states: the residual stream bf16(P + m)
// after layer l when l + 1 is listed (0: the embeddings), [aux, m, D].
#pragma once

#include <cstdint>
#include <vector>

#include "comm/comm.h"
#include "config/model_config.h"
#include "model/layers.h"
#include "model/weights.h"

namespace k3 {

enum class StepKind { Auto, Stock, Hybrid };
const char* step_kind_name(StepKind k);

struct StepEnv {
  const ModelConfig* config = nullptr;
  const LayerPlan* plan = nullptr;
  const ModelWeights* weights = nullptr;
  AttentionCache* cache = nullptr;
  Comm* tp = nullptr;
  Comm* world = nullptr;
  Dcp dcp;
  std::vector<int> aux_layers;
};

// Rows of this rank's shard (c) and how many of them are real tokens.
int64_t sp_shard_rows(int64_t m, int G);
int64_t sp_shard(const float* x, int64_t m, int64_t D, int G, int t, float* shard);
// shard [c, D] of every tp rank -> all [G c, D].
void sp_all_gather(Comm& tp, const float* shard, int64_t c, int64_t D, float* all);
// The MoE of layer l on this rank's shard of x [m, D], gathered back: out [m, D].
void run_stock_moe(const StepEnv& env, int layer, const float* x, int64_t m, float* out);
// The dense MLP on all m rows with the replicated weights.
void run_dense(const StepEnv& env, int layer, const float* x, int64_t m, float* out);

struct StepOutput {
  std::vector<float> logits;  // [m, V] FP32
  std::vector<float> aux;     // [aux layers, m, D]
};

class StockStep {
 public:
  static StepOutput run(const StepEnv& env, const int32_t* tokens, const StepShape& shape);
};

class HybridStep {
 public:
  static StepOutput run(const StepEnv& env, const int32_t* tokens, const StepShape& shape);
};

}  // namespace k3
