// Engine: one rank's decode runtime on the CPU reference path.
//
// Requests live in slots. admit() takes a free slot; step() runs B requests x
// q tokens (q = 1 decode, q > 1 a verify step or a prefill chunk) and returns
// FP32 logits [B q, V]; every request of a step is then pending until
// commit(slot, n) accepts its first n <= q tokens: the request's length grows
// by n and its KDA state becomes the state after exactly those n tokens.
// prefill() feeds a prompt in chunks of max_q, committing each.
//
// On a multi-rank layout every rank of a DP replica holds an Engine with the
// same requests and calls step() with the same arguments; the replicas step
// together (a replica with no requests steps with B = 0: the MoE exchange
// spans every rank). The step kind: choose_step (runtime/steps.h).
//
// Bad input (unknown or busy slot, token id out of range, a step past the
// cache, too many requests) is an Error raised before anything is written, so
// no other request's state is touched (SlotTable::validate_step, agreed over
// the world by agree_on_input).
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "comm/comm.h"
#include "config/model_config.h"
#include "io/checkpoint.h"
#include "model/weights.h"
#include "runtime/cache.h"
#include "runtime/steps.h"

namespace k3 {

struct EngineOptions {
  EngineOptions(const CacheOptions& c = {}) : cache(c) {}  // NOLINT: a CacheOptions is a complete EngineOptions
  CacheOptions cache;
  StepKind step = StepKind::Auto;
  int64_t moe_capacity = 256;   // per-rank MoE token capacity (auto's rule, runtime/steps.h)
  SharedExperts shared = SharedExperts::Replicated;  // tp: the shared experts / dense MLP TP-sharded (hybrid only)
  std::vector<int> aux_layers;  // capture the stream entering these layers (0 = embeddings; L = after the last)
};

class Engine {
 public:
  // Single rank: the whole model, trivial groups.
  Engine(std::shared_ptr<const TensorSource> src, const ModelConfig& config, const EngineOptions& options);
  // Rank `world_rank` of `layout`, with its groups (comm/local.h, comm/mpi.h).
  Engine(std::shared_ptr<const TensorSource> src, const ModelConfig& config, const EngineOptions& options,
         const Layout& layout, int world_rank, RankGroups groups);

  const ModelConfig& config() const { return config_; }
  const CacheOptions& options() const { return caches_.options(); }
  const Layout& layout() const { return layout_; }
  int world_rank() const { return world_rank_; }

  // A free slot, the pages of `reserve_tokens` positions set aside (SlotTable::admit); Error when none.
  int admit(int64_t reserve_tokens = 0);
  bool can_admit(int64_t tokens) const { return caches_.table().can_admit(tokens); }
  bool fits(int64_t tokens) const { return caches_.table().fits(tokens); }
  void release(int slot);
  int64_t length(int slot) const { return caches_.table().length(slot); }  // committed tokens
  bool pending(int slot) const { return caches_.table().pending(slot); }

  // tokens [B * q], request b's tokens at [b q, (b+1) q). Returns logits [B * q, V].
  std::vector<float> step(std::span<const int> slots, int q, std::span<const int32_t> tokens);
  void commit(int slot, int n);
  // Feeds `prompt` and commits it; returns the logits of every prompt position [len, V].
  std::vector<float> prefill(int slot, std::span<const int32_t> prompt);

  StepKind choose_step(int64_t rows, int q) const;
  StepOptions step_options() const { return {opts_.step, opts_.moe_capacity, opts_.shared}; }
  StepKind last_step() const { return last_step_; }
  const std::vector<float>& last_aux() const { return last_aux_; }  // [aux layers, rows, D]
  // Collective counts of this rank's groups (tests and docs).
  const CountingComm& tp_comm() const { return *tp_; }
  const CountingComm& dcp_comm() const { return *dcp_; }
  const CountingComm& world_comm() const { return *world_; }
  void reset_counts();
  Comm& world() { return *world_; }

 private:

  std::shared_ptr<const TensorSource> src_;
  ModelConfig config_;
  EngineOptions opts_;
  Layout layout_;
  int world_rank_ = 0;
  LayerPlan plan_;
  ModelWeights weights_;
  Caches caches_;
  std::unique_ptr<CountingComm> tp_, dcp_, world_;
  StepKind last_step_ = StepKind::Auto;
  std::vector<float> last_aux_;
};

}  // namespace k3
