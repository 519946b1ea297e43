// GpuDecoder: generate() on one GPU (CUDA builds; `k3decode generate --device gpu`). One GpuRank holds the whole
// model (a one-rank layout); each step is its CUDA graph for (B, q), captured
// on first use and replayed after. Multi-rank GPU layouts run through
// LocalGpuCluster (tests) and the nccl backend; they are not a Decoder yet.
#pragma once

#include <memory>

#include "io/checkpoint.h"
#include "ops/cuda_context.h"
#include "runtime/generate.h"
#include "runtime/gpu_rank.h"

namespace k3 {

class GpuDecoder : public Decoder {
 public:
  // Uploads the weights of `src` (validated as the CPU engine does) to the current device.
  GpuDecoder(const TensorSource& src, const ModelConfig& config, const GpuRankOptions& options);
  ~GpuDecoder() override;

  const ModelConfig& config() const override { return config_; }
  const Layout& layout() const override { return layout_; }
  int world_rank() const override { return 0; }
  int max_slots() const override { return options_.max_slots; }
  int max_q() const override { return options_.max_q; }
  int64_t max_context() const override { return options_.max_context; }
  int admit() override { return rank_->admit(); }
  void release(int slot) override { rank_->release(slot); }
  std::vector<float> step(std::span<const int> slots, int q, std::span<const int32_t> tokens) override;
  void commit(std::span<const int> slots, int q) override;
  void world_sum(float*, int64_t) override {}

 private:
  ModelConfig config_;
  GpuRankOptions options_;
  Layout layout_;
  std::unique_ptr<ops::cuda::Context> ctx_;
  std::unique_ptr<GpuRank> rank_;
};

}  // namespace k3
