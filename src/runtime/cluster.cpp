// LocalCluster (runtime/cluster.h): Engines as threads of one process.
#include "runtime/cluster.h"

#include "comm/local.h"
#include "comm/thread_groups.h"

namespace k3 {

LocalCluster::LocalCluster(std::shared_ptr<const TensorSource> src, const ModelConfig& config,
                           const EngineOptions& options, const Layout& layout)
    : layout_(layout) {
  layout_.validate();
  check_shardable(config, ShardSpec{layout.tp, 0, layout.world(), 0});
  auto groups = make_local_world(layout_);
  for (int w = 0; w < layout_.world(); ++w)
    engines_.push_back(std::make_unique<Engine>(src, config, options, layout_, w, std::move(groups[w])));
}

void LocalCluster::run(const std::function<void(int, Engine&)>& fn) {
  run_rank_threads(layout_.world(), [&](int w) { fn(w, *engines_[w]); });
}

}  // namespace k3
