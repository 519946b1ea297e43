// The two decode steps of one rank (design.md section 2; the seed's HybridStep),
// written once over a StepBackend (runtime/step_backend.h) for the CPU and the GPU.
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
//   rows -> MoE: the stock MoE module on the rank's shard, all-gathered back
//   (sp_shard, moe, sp_all_gather, trim), or the dense MLP on all rows
//   (replicated weights, no collective).
//   With TP-sharded shared experts (SharedExperts::Tp): the routed part on the
//   rank's shard, the rank's partial of the shared experts on all rows, the
//   shard's rows added to it, one all_reduce (tp); the dense MLP a partial sum
//   on all rows, all-reduced.
// Both end with the final AttnRes, the norm and the vocab-parallel lm_head
// (its slices all-gathered over tp), so every rank of the replica returns
// the same logits [m, V]. Aux hidden states: the residual stream bf16(P + f)
// after layer l when l + 1 is listed (0: the embeddings), [aux, m, D].
// A replica with no rows (m = 0) runs only the MoE layers' EP exchanges.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "config/model_config.h"
#include "runtime/step_backend.h"

namespace k3 {

// Rows of this rank's shard (c) and how many of them are real tokens.
int64_t sp_shard_rows(int64_t m, int G);
int64_t sp_shard(const float* x, int64_t m, int64_t D, int G, int t, float* shard);
// shard [c, D] of every tp rank -> all [G c, D].
void sp_all_gather(Comm& tp, const float* shard, int64_t c, int64_t D, float* all);

// Where the shared experts and the dense MLP run: `replicated` (the seed's hybrid step: each rank runs
// them on its row shard with whole weights; the stock step needs this), or `tp` (the hybrid step only:
// TP-sharded over the group on all rows, their partial sums meeting the routed rows in one all-reduce
// that replaces the all-gather; each rank reads 1/G of their weights).
enum class SharedExperts { Replicated, Tp };
const char* shared_experts_name(SharedExperts s);
// The default of a step: tp for --step hybrid, replicated otherwise (--step auto too: with tp a row's bits
// depend on which rank owns it in the step, docs/PARALLEL.md, so a request's greedy tokens could depend on
// its batch at near-ties).
SharedExperts default_shared_experts(StepKind step);
// --shared-experts as given (empty or "auto": the default above; "replicated"; "tp"); Error otherwise.
SharedExperts parse_shared_experts(const std::string& flag, StepKind step);

// How a runtime picks the step for a step of `rows` rows and q tokens per request.
struct StepOptions {
  StepKind step = StepKind::Auto;
  int64_t moe_capacity = 256;  // per-rank MoE token capacity (auto's rule)
  SharedExperts shared = SharedExperts::Replicated;
};
// Errors for a combination that cannot run (stock with TP-sharded shared experts).
void validate(const StepOptions& o);
// `stock` / `hybrid` force one; `auto` takes hybrid when q > 1, rows % q == 0 and
// ceil(rows / G) <= moe_capacity (the seed's wide-batch rule), else stock. On one
// rank (G = 1) the two steps are the same computation and auto takes hybrid; with
// TP-sharded shared experts only the hybrid step can run, so auto takes it.
StepKind choose_step(const StepOptions& o, int64_t rows, int q, int G);

// Runs `validate`; on a multi-rank layout (world_sum given) the ranks then agree
// with one 4-byte world sum, so an input that one rank rejects raises an Error
// on every rank and none is left waiting in a collective.
// A rank whose own input was fine raises PeerRejectedInput (the rejecting ranks raise their own Error).
void agree_on_input(const std::function<void()>& validate, const std::function<void(float*)>& world_sum);
class PeerRejectedInput : public Error {
 public:
  PeerRejectedInput() : Error("step: aborted because another rank rejected its input") {}
};

class StockStep {
 public:
  static void run(StepBackend& be, const ModelConfig& c, const LayerPlan& plan, const StepRows& rows,
                  const std::vector<int>& aux_layers);
};

class HybridStep {
 public:
  static void run(StepBackend& be, const ModelConfig& c, const LayerPlan& plan, const StepRows& rows,
                  const std::vector<int>& aux_layers);
};

// The step of `kind` (Stock or Hybrid).
void run_step(StepKind kind, StepBackend& be, const ModelConfig& c, const LayerPlan& plan, const StepRows& rows,
              const std::vector<int>& aux_layers);

}  // namespace k3
