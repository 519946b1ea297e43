// LocalCluster: a whole G x DP layout in one process, one Engine per world
// rank (ranks as threads, comm/local.h). run(fn) calls fn(rank, engine) on
// every rank concurrently and rethrows the first error; fn must issue the same
// collective sequence on every rank (e.g. the same Engine calls on the ranks
// of a replica, and one step per replica per round).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "runtime/engine.h"

namespace k3 {

class LocalCluster {
 public:
  LocalCluster(std::shared_ptr<const TensorSource> src, const ModelConfig& config, const EngineOptions& options,
               const Layout& layout);
  const Layout& layout() const { return layout_; }
  Engine& engine(int world_rank) { return *engines_.at(world_rank); }
  void run(const std::function<void(int, Engine&)>& fn);

 private:
  Layout layout_;
  std::vector<std::unique_ptr<Engine>> engines_;
};

}  // namespace k3
