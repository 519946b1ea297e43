// GpuRank: one rank's decode step on an NVIDIA GPU, built from the CUDA ops
// (src/ops/*.cu), with the data flow of runtime/steps.h:
//   HybridStep: AttnRes on all rows -> attention of the local heads -> o_proj
//   partial -> all-reduce -> AttnRes -> MoE on the row shard (gathered back) /
//   dense MLP on all rows; StockStep: the residual on the row shard, all-gather
//   before attention, reduce-scatter after.
// Collectives (runtime/gpu_collectives.h): on a one-rank layout they are
// identities; with `loopback` (the rank-slice benchmark, design.md section 6)
// each moves the bytes the real collective would move through device copies,
// and the MoE routes every (row, expert) pair of the rank's shard to one of its
// local experts (uniform spread, as an EP exchange over W ranks delivers on
// average); with `groups` (real) they run on the rank's device comms:
//   TP: all-reduce (hybrid), all-gather / reduce-scatter of row shards (stock),
//       the MoE shard gathered back (hybrid), the lm_head's vocab all-gather;
//   DCP (dcp > 1): the cache holds positions p mod D at local index p / D;
//       queries all-gathered over the DCP group, each rank attends every
//       gathered head over its positions, partial (o, lse) back to the head's
//       owner by all-to-all, lse_merge; DSA's top-k global over the shards;
//   EP over the world: a fixed-capacity exchange (ops/ep.h) that fits CUDA
//       graphs: cap = ceil(max_batch max_q / G) k slots per peer, [W, cap] ids
//       and [W, cap, L] latent rows each way per MoE layer whatever the step's
//       rows (the same shapes on every rank, nothing read back to the host).
// A replica with no requests steps with B = 0 (prepare() with no slots): only
// the EP exchanges run, so the other replicas' MoE layers can complete.
// Everything a step needs is allocated up front; a step issues kernels and
// async copies on one stream only, with no host synchronization, so it is
// captured once per (kind, B, q) as a CUDA graph and replayed.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/cuda.h"
#include "model/weights.h"
#include "ops/cuda_context.h"
#include "ops/moe.h"
#include "runtime/gpu_collectives.h"
#include "runtime/steps.h"

namespace k3 {

// Device copies of one rank's weights: a ModelWeights whose pointers are device pointers.
struct GpuWeights {
  ModelWeights w;
  std::vector<ops::cuda::Mxfp4ExpertTable> tables;  // per layer (MoE layers only)
  std::vector<DeviceBuffer> bufs;
  size_t bytes = 0;
};

// Fills a device buffer: from `host` (nullptr when building without host weights).
using GpuFill = std::function<void(void* dev, const void* host, size_t bytes, DType dt, const std::string& role)>;
GpuWeights build_gpu_weights(const ModelConfig& c, const ShardSpec& shard, const ModelWeights* host,
                             const GpuFill& fill);
// The upload fill (cudaMemcpy from host).
GpuFill upload_fill();

struct GpuRankOptions {
  int max_slots = 8;
  int max_batch = 8;            // requests per step
  int max_q = 16;               // tokens per request per step
  int64_t max_context = 512;
  int page_size = 64;
  ShardSpec shard;              // the split of the weights
  bool loopback = false;        // collectives move bytes only (tp_size / world_size > 1)
  RankGroups* groups = nullptr; // real collectives: this rank's device comms (outlive the GpuRank)
};

// Device scratch of a GpuRank, a pure function of the config and the capacities
// (allocated once, at construction): the per-layer work area (an upper bound of
// every layer kind's intermediates at max_batch x max_q rows, plus the gathers
// and the lm_head slice) and the attention kernels' split-K partials.
struct GpuWorkspace {
  size_t work_bytes = 0;   // the per-layer area (layer_bytes) + the step's gathers and lm_head slices
  size_t layer_bytes = 0;  // the per-layer area alone (what a layer's scratch may use)
  size_t attention_bytes = 0;
};
GpuWorkspace gpu_workspace(const ModelConfig& c, const GpuRankOptions& o);

class GpuRank {
 public:
  GpuRank(const ModelConfig& c, GpuWeights weights, const GpuRankOptions& o, ops::cuda::Context& ctx);
  ~GpuRank();

  int admit();
  void release(int slot);
  int64_t length(int slot) const { return slots_.at(slot).length; }
  // Benchmarks: gives a request `length` cached tokens without running them
  // (pages reserved; cache contents as they are).
  void set_context(int slot, int64_t length);
  // Device pools of the caches (benchmarks fill them with random data).
  struct Pool {
    void* ptr;
    size_t bytes;
    bool f32;  // F32 (KDA states) or BF16 (latent cache, indexer keys)
  };
  std::vector<Pool> cache_pools();

  // Validates (Error before anything is written), reserves pages and uploads the
  // step's metadata (async, from pinned staging, outside any graph).
  void prepare(std::span<const int> slots, int q, std::span<const int32_t> tokens);
  // The step's kernels on the stream (capturable). prepare() first.
  void enqueue(StepKind kind);
  // Captures enqueue(kind) for the prepared (B, q) once and replays it.
  void run_graph(StepKind kind);
  std::vector<float> logits();  // synchronizes; [B q, V]
  // Commits the first n of the last step's q tokens of each slot (kernels + bookkeeping).
  void commit(std::span<const int> slots, std::span<const int> accepted);

  // Profile mode (eager, events between op groups): milliseconds per op group of
  // one step, in first-seen order. prepare() first.
  std::vector<std::pair<std::string, double>> profile(StepKind kind);

  size_t weight_bytes() const { return weights_.bytes; }
  size_t cache_bytes() const { return cache_bytes_; }
  int64_t rows() const { return int64_t{B_} * q_; }
  CUstream_st* stream() const { return ctx_.stream; }

 private:
  struct Slot {
    bool active = false;
    int64_t length = 0;
    std::vector<int32_t> pages;
  };
  void layer(StepKind kind, int l);
  void attention(int l, const bf16* x, bf16* out);
  void moe(int l, const bf16* x, int64_t rows, bf16* out);
  void ep_experts(int l, const bf16* z, const int32_t* idx, const float* wts, int64_t rows, bf16* y, size_t& at);
  bf16* scratch_bf16(size_t& at, int64_t n);
  float* scratch_f32(size_t& at, int64_t n);

  ModelConfig c_;
  GpuWeights weights_;
  GpuRankOptions o_;
  ops::cuda::Context& ctx_;
  LayerPlan plan_;
  int G_ = 1;
  GpuCollectives coll_;
  int64_t ep_cap_ = 0;    // EP slots per peer (real mode)
  DeviceBuffer ep_ones_;  // F32 [W ep_cap_] = 1: the weights of the received pairs
  int Hk_ = 0, Hm_ = 0;  // local KDA / MLA heads
  int max_pages_ = 0;
  std::vector<Slot> slots_;
  std::vector<int32_t> free_pages_;
  // Caches.
  std::vector<DeviceBuffer> conv_, conv_hist_, state_, state_hist_;  // per KDA layer: 3 convs, 3 hists, S, S hist
  std::vector<DeviceBuffer> kv_, index_;                              // per full-attention layer
  std::vector<int> kda_index_, full_index_;
  size_t cache_bytes_ = 0;
  // Step metadata (device) and its pinned staging.
  DeviceBuffer d_tokens_, d_slots_, d_pos0_, d_ctx_, d_ctx_local_, d_tables_, d_accepted_;
  void* pinned_ = nullptr;
  size_t pinned_bytes_ = 0;
  int B_ = 0, q_ = 0;
  bool prepared_ = false;
  int64_t max_ctx_ = 0;  // the step's largest visible context
  // Activations and scratch.
  DeviceBuffer P_, blocks_, x_, a_, f_, logits_, work_, attn_scratch_;
  size_t work_bytes_ = 0, layer_bytes_ = 0, attn_scratch_bytes_ = 0;
  void mark(const char* label);
  bool profiling_ = false;
  std::vector<cudaEvent_t> events_;
  std::vector<const char*> labels_;
  size_t n_marks_ = 0;
  struct Graph {
    StepKind kind;
    int B, q;
    cudaGraphExec_t exec;
  };
  std::vector<Graph> graphs_;
};

}  // namespace k3
