// LocalGpuCluster: a whole G x DP layout on one GPU (mirrors LocalCluster):
// one GpuRank per world rank, each with its own cu::Context (stream, cuBLASLt
// handle, workspace) and its own weight shard, the ranks' groups from
// comm/local_gpu.h (collectives by device copies and the rank-order reduction
// kernel). run(fn) calls fn(rank, gpu_rank) on one host thread per rank and
// rethrows the first error; fn must issue the same collective sequence on
// every rank (the same GpuRank calls on the ranks of a replica, one step per
// replica per round: an idle replica prepares B = 0).
//
// The ranks share the device: memory is the sum of the ranks' weights, caches
// and workspaces (GpuRank::weight_bytes / cache_bytes + gpu_workspace) plus
// a 32 MiB cuBLASLt workspace per rank. Steps run eagerly (enqueue()): the
// local GPU backend cannot be captured in CUDA graphs.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "comm/comm.h"
#include "io/checkpoint.h"
#include "runtime/gpu/rank.h"

namespace k3 {

class LocalGpuCluster {
 public:
  // `options` for every rank (shard, groups and loopback are set per rank here).
  LocalGpuCluster(const TensorSource& src, const ModelConfig& config, const GpuRankOptions& options,
                  const Layout& layout);
  ~LocalGpuCluster();
  LocalGpuCluster(const LocalGpuCluster&) = delete;
  LocalGpuCluster& operator=(const LocalGpuCluster&) = delete;

  const Layout& layout() const { return layout_; }
  GpuRank& rank(int world_rank) { return *ranks_.at(world_rank); }
  int device() const { return device_; }
  RankGroups& groups(int world_rank) { return groups_.at(world_rank); }
  void run(const std::function<void(int, GpuRank&)>& fn);

 private:
  Layout layout_;
  int device_ = 0;
  std::vector<std::unique_ptr<ops::cuda::ScopedContext>> contexts_;
  std::vector<RankGroups> groups_;
  std::vector<std::unique_ptr<GpuRank>> ranks_;
};

class LayoutDecoder;
// Every rank of `cluster` as a GpuDecoder (eager steps) behind one LayoutDecoder (runtime/layout_decoder.h: the
// Scheduler's decoder for `serve --device gpu --tp/--dp`); each rank thread runs on the cluster's device. `options`:
// the cluster's. The cluster outlives the decoder.
std::unique_ptr<LayoutDecoder> make_layout_decoder(LocalGpuCluster& cluster, const ModelConfig& config,
                                                   const GpuRankOptions& options);

}  // namespace k3
