// GpuRank: one rank's decode step on an NVIDIA GPU. It is the GPU's
// StepBackend (runtime/step_backend.h): the one step loop of runtime/steps.h
// runs on it, each call enqueuing CUDA ops (src/ops/*.cu) on the rank's stream.
// Its parts, one file each in runtime/gpu/:
//   weights     the weights on the device (one factory for every caller)
//   caches      the KDA states and the paged latent / indexer pools
//   workspace   the scratch, carved by one function per module
//   attention   the attention modules (KDA, MLA / DSA with DCP)
//   moe         the MoE (router, EP exchange, experts, shared experts) and the dense MLP
//   graphs      a CUDA graph per (step, B, q)
//   profile     per-op-group events (bench --profile)
// and runtime/slot_table.h: the slots, lengths and pages (shared with the CPU engine).
// Collectives (runtime/gpu/collectives.h): identities on one rank; with
// `loopback` (the rank-slice benchmark, design.md section 6) each moves the
// bytes the real collective would move, and the MoE routes every pair of the
// rank's shard to one of its local experts (uniform spread, as an EP exchange
// over W ranks delivers on average); with `groups` (real) they run on the
// rank's device comms:
//   TP: all-reduce (hybrid), all-gather / reduce-scatter of row shards (stock),
//       the MoE shard gathered back (hybrid), the lm_head's vocab all-gather;
//   DCP (dcp > 1): the cache holds positions p mod D at local index p / D
//       (1/D of the context); queries all-gathered over the DCP group, each
//       rank attends every gathered head over its positions, partial (o, lse)
//       back to the head's owner by all-to-all, lse_merge; DSA's top-k global;
//   EP over the world: a fixed-capacity exchange (ops/ep.h) that fits CUDA
//       graphs: cap = ceil(max_batch max_q / G) k slots per peer.
// A replica with no requests steps with B = 0 (prepare() with no slots): only
// the EP exchanges run, so the other replicas' MoE layers can complete.
// Everything a step needs is allocated up front; a step issues kernels and
// async copies on one stream only, with no host synchronization, so it is
// captured once per (kind, B, q) as a CUDA graph and replayed.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/cuda.h"
#include "ops/cuda_context.h"
#include "ops/rmsnorm.h"
#include "ops/sampling.h"
#include "runtime/gpu/caches.h"
#include "runtime/gpu/collectives.h"
#include "runtime/gpu/graphs.h"
#include "runtime/gpu/options.h"
#include "runtime/gpu/profile.h"
#include "runtime/gpu/weights.h"
#include "runtime/gpu/workspace.h"
#include "runtime/slot_table.h"
#include "runtime/step_backend.h"
#include "runtime/steps.h"

namespace k3 {

class GpuRank final : private StepBackend {
 public:
  GpuRank(const ModelConfig& c, GpuWeights weights, const GpuRankOptions& o, ops::cuda::Context& ctx);
  ~GpuRank() override;

  const GpuRankOptions& options() const { return o_; }
  int admit(int64_t reserve_tokens = 0);  // SlotTable::admit
  bool can_admit(int64_t tokens) const { return table_.can_admit(tokens); }
  bool fits(int64_t tokens) const { return table_.fits(tokens); }
  void release(int slot);
  int64_t length(int slot) const { return table_.length(slot); }
  // Benchmarks: gives a request `length` cached tokens without running them
  // (pages reserved; cache contents as they are).
  void set_context(int slot, int64_t length);
  using Pool = GpuCaches::Pool;
  std::vector<Pool> cache_pools() { return caches_.pools(); }  // benchmarks fill them with random data

  // Validates (SlotTable::validate_step; with real collectives the world agrees
  // on it, so every rank raises when one rejects its input), reserves pages and
  // uploads the step's metadata (async, from pinned staging, outside any
  // graph). A prepared step that is not committed may be prepared again.
  void prepare(std::span<const int> slots, int q, std::span<const int32_t> tokens);
  // The step's kernels on the stream (capturable). prepare() first.
  void enqueue(StepKind kind);
  // Captures enqueue(kind) for the prepared (B, q) once and replays it.
  void run_graph(StepKind kind);
  std::vector<float> logits();  // synchronizes; [B q, V]
  // Synchronizes; [B q]: ops::cuda::sample_rows on the step's logits by spec [B q] (checked here): only the
  // specs go up and the small records come back.
  std::vector<ops::SampleResult> sample(std::span<const ops::SampleSpec> spec);
  // Commits the first n of the last step's q tokens of each slot (kernels + bookkeeping).
  void commit(std::span<const int> slots, std::span<const int> accepted);

  // Profile mode (eager, events between op groups): milliseconds per op group of
  // one step, in first-seen order. prepare() first.
  std::vector<std::pair<std::string, double>> profile(StepKind kind);

  size_t weight_bytes() const { return weights_.bytes; }
  size_t cache_bytes() const { return caches_.bytes(); }
  int64_t rows() const { return int64_t{B_} * q_; }
  CUstream_st* stream() const { return ctx_.stream; }

 private:
  // StepBackend.
  const ModelWeights& weights() const override { return weights_.w; }
  void begin(StepKind kind, const StepRows& r) override;
  void embed(int64_t row0, int64_t rows, int64_t res_rows) override;
  void attn_res(const ResMix& r) override;
  void rmsnorm(Act x, const bf16* w, int64_t rows) override;
  void copy_rows(Act dst, Act src, int64_t rows) override;
  void attention(int layer, Act x, Act out) override;  // gpu/attention.cpp
  // gpu/moe.cpp
  void moe(int layer, Act x, int64_t row0, int64_t cs, int64_t real, Act out, SharedPart shared) override;
  void dense(int layer, Act x, int64_t rows, Act out) override;
  void lm_head(Act h, int64_t m) override;
  void all_gather_rows(Act shard, Act all, int64_t m) override;
  void reduce_scatter_rows(Act partial, Act shard, int64_t m) override;
  void all_reduce(Act a, int64_t m) override;
  void capture_aux(bool with_delta, int64_t rows, bool gather) override;

  bf16* act(Act a);
  Carve layer_scratch() { return Carve(work_.get<char>(), layer_bytes_); }
  void kda(int l, const bf16* x, bf16* out);
  void mla(int l, const bf16* x, bf16* out);
  void ep_experts(int l, const MoeScratch& m, int64_t routed, int64_t own0, int64_t real,
                  const ops::cuda::RowNorm& norm);
  void world_sum(float* v);  // real collectives: a 4-byte world all-reduce through the device
  void mark(const char* label) { prof_.mark(label, ctx_.stream); }

  ModelConfig c_;
  GpuWeights weights_;
  GpuRankOptions o_;
  ops::cuda::Context& ctx_;
  LayerPlan plan_;
  GpuDims dims_;
  int G_ = 1;
  GpuCollectives coll_;
  SlotTable table_;
  GpuCaches caches_;
  int max_pages_ = 0;     // block table stride (the longest table of a slot)
  DeviceBuffer ep_ones_;  // F32 [W ep_cap] = 1: the weights of the received pairs
  // Step metadata (device) and its pinned staging.
  DeviceBuffer d_tokens_, d_slots_, d_pos0_, d_ctx_, d_ctx_local_, d_tables_, d_accepted_, d_agree_, d_spec_, d_sampled_;
  DeviceBuffer sample_scratch_;  // ops::cuda::sample_rows' (zeroed once, at allocation)
  // [2][max_batch]: each request's KDA state to read (the slot's current) and to write (GpuCaches::read_state /
  // write_state), rewritten by prepare() and commit() like d_slots_, so graphs stay valid across flips.
  DeviceBuffer d_state_idx_;
  void upload_state_idx(const int32_t* idx, int B);  // idx [2][B] from pinned staging
  void* pinned_ = nullptr;
  int B_ = 0, q_ = 0;
  bool prepared_ = false;
  StepKind kind_ = StepKind::Hybrid;  // of the step being enqueued
  StepRows rows_;
  int64_t max_ctx_ = 0;  // the step's largest visible context
  // Activations and scratch.
  DeviceBuffer P_, blocks_, x_, a_, f_, logits_, work_, attn_scratch_;
  size_t layer_bytes_ = 0, attn_scratch_bytes_ = 0;
  DeviceBuffer topk_scratch_;  // ops::cuda::topk_indices' (DSA layers only; zeroed once, at allocation)
  StepScratch step_;
  StepProfiler prof_;
  GraphCache graphs_;
};

}  // namespace k3
