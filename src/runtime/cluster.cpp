#include "runtime/cluster.h"

#include <exception>
#include <mutex>
#include <thread>

#include "comm/local.h"

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
  std::exception_ptr first;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int w = 0; w < layout_.world(); ++w)
    threads.emplace_back([&, w] {
      try {
        fn(w, *engines_[w]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace k3
