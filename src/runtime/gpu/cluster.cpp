// LocalGpuCluster (runtime/gpu/cluster.h): GpuRanks as threads on one GPU.
#include "runtime/gpu/cluster.h"

#include "comm/local_gpu.h"
#include "comm/thread_groups.h"
#include "runtime/gpu/decoder.h"
#include "runtime/layout_decoder.h"

namespace k3 {

LocalGpuCluster::LocalGpuCluster(const TensorSource& src, const ModelConfig& config, const GpuRankOptions& options,
                                 const Layout& layout)
    : layout_(layout) {
  layout_.validate();
  const int W = layout_.world();
  check_shardable(config, ShardSpec{layout_.tp, 0, W, 0});
  CUDA_CHECK(cudaGetDevice(&device_));
  groups_ = make_local_gpu_world(layout_);
  try {
    for (int w = 0; w < W; ++w) {
      contexts_.push_back(std::make_unique<ops::cuda::ScopedContext>());
      GpuRankOptions o = options;
      o.shard = ShardSpec{layout_.tp, layout_.tp_rank(w), W, w, o.steps.shared == SharedExperts::Tp};
      o.loopback = false;
      o.groups = &groups_[w];
      ranks_.push_back(std::make_unique<GpuRank>(config, load_gpu_weights(src, config, o.shard), o,
                                                 contexts_.back()->get()));
    }
  } catch (...) {
    ranks_.clear();  // before the contexts they run on
    throw;
  }
}

LocalGpuCluster::~LocalGpuCluster() {
  for (auto& c : contexts_) cudaStreamSynchronize(c->get().stream);
  ranks_.clear();
  groups_.clear();
  contexts_.clear();
}

void LocalGpuCluster::run(const std::function<void(int, GpuRank&)>& fn) {
  run_rank_threads(layout_.world(), [&](int w) {
    CUDA_CHECK(cudaSetDevice(device_));
    fn(w, *ranks_[w]);
  });
}

std::unique_ptr<LayoutDecoder> make_layout_decoder(LocalGpuCluster& cluster, const ModelConfig& config,
                                                   const GpuRankOptions& options) {
  std::vector<std::unique_ptr<Decoder>> ranks;
  const Layout& L = cluster.layout();
  for (int w = 0; w < L.world(); ++w)
    ranks.push_back(std::make_unique<GpuDecoder>(cluster.rank(w), config, options, L, w, *cluster.groups(w).world,
                                                 /*graphs=*/false));
  const int device = cluster.device();
  return std::make_unique<LayoutDecoder>(std::move(ranks), [device](int) { CUDA_CHECK(cudaSetDevice(device)); });
}

}  // namespace k3
