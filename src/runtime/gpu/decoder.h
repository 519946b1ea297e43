// GpuDecoder: generate() on GPUs (CUDA builds; `k3decode generate --device gpu`).
//   - one GPU, the whole model: the decoder owns its GpuRank; each step is its
//     CUDA graph for (B, q), captured on first use and replayed after;
//   - one rank of a multi-rank layout: a GpuRank with real collectives (its
//     RankGroups: local_gpu for ranks as threads on one GPU, stepped eagerly
//     since that backend cannot be captured; nccl for a process per GPU, as
//     graphs). world_sum stages the host floats through a device buffer and
//     the world group's all-reduce.
// Each step takes choose_step(options.steps) (runtime/steps.h): --step
// stock | hybrid | auto on the GPU as on the CPU.
#pragma once

#include <memory>

#include "core/cuda.h"
#include "io/checkpoint.h"
#include "ops/cuda_context.h"
#include "runtime/generate.h"
#include "runtime/gpu/rank.h"

namespace k3 {

class GpuDecoder : public Decoder {
 public:
  // One GPU: uploads the weights of `src` to the current device.
  GpuDecoder(const TensorSource& src, const ModelConfig& config, const GpuRankOptions& options);
  // World rank `world_rank` of `layout`: `rank` built with options.groups (which hold `world`, the
  // world group's device comm); both outlive the decoder.
  GpuDecoder(GpuRank& rank, const ModelConfig& config, const GpuRankOptions& options, const Layout& layout,
             int world_rank, Comm& world, bool graphs);
  ~GpuDecoder() override;
  StepKind last_step() const { return last_step_; }

  const ModelConfig& config() const override { return config_; }
  const Layout& layout() const override { return layout_; }
  int world_rank() const override { return world_rank_; }
  int max_slots() const override { return options_.max_slots; }
  int max_q() const override { return options_.max_q; }
  int64_t max_context() const override { return options_.max_context; }
  int admit(int64_t reserve_tokens) override { return rank_->admit(reserve_tokens); }
  bool can_admit(int64_t tokens) const override { return rank_->can_admit(tokens); }
  bool fits(int64_t tokens) const override { return rank_->fits(tokens); }
  void release(int slot) override { rank_->release(slot); }
  std::vector<float> step(std::span<const int> slots, int q, std::span<const int32_t> tokens) override;
  std::vector<ops::SampleResult> step_sample(std::span<const int> slots, int q, std::span<const int32_t> tokens,
                                             std::span<const ops::SampleSpec> spec) override;
  void commit(std::span<const int> slots, int q) override;
  void commit(std::span<const int> slots, std::span<const int> counts) override;
  void world_sum(float* data, int64_t n) override;

 private:
  ModelConfig config_;
  GpuRankOptions options_;
  Layout layout_;
  int world_rank_ = 0;
  Comm* world_ = nullptr;
  bool graphs_ = true;
  std::unique_ptr<ops::cuda::ScopedContext> ctx_;  // owned (one GPU) or null
  std::unique_ptr<GpuRank> owned_;
  GpuRank* rank_ = nullptr;
  DeviceBuffer staging_;  // world_sum
  StepKind last_step_ = StepKind::Auto;
  void run(std::span<const int> slots, int q, std::span<const int32_t> tokens);  // prepare + the step
};

}  // namespace k3
