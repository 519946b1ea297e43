// GpuDecoder (runtime/gpu_decoder.h).
#include "runtime/gpu_decoder.h"

namespace k3 {

GpuDecoder::GpuDecoder(const TensorSource& src, const ModelConfig& config, const GpuRankOptions& options)
    : config_(config), options_(options) {
  K3_CHECK(options.shard.tp_size == 1 && options.shard.world_size == 1 && !options.loopback,
           "gpu generate: one rank holds the whole model (tp = dp = 1)");
  ctx_ = std::make_unique<ops::cuda::Context>(ops::cuda::create_context());
  const ModelWeights host = load_weights(config, src);
  rank_ = std::make_unique<GpuRank>(config, build_gpu_weights(config, {}, &host, upload_fill()), options, *ctx_);
}

GpuDecoder::~GpuDecoder() {
  rank_.reset();
  if (ctx_) ops::cuda::destroy_context(*ctx_);
}

std::vector<float> GpuDecoder::step(std::span<const int> slots, int q, std::span<const int32_t> tokens) {
  rank_->prepare(slots, q, tokens);  // validates before anything is written
  rank_->run_graph(StepKind::Hybrid);  // one rank: the two steps are the same computation
  return rank_->logits();
}

void GpuDecoder::commit(std::span<const int> slots, int q) {
  const std::vector<int> accepted(slots.size(), q);
  rank_->commit(slots, accepted);
}

}  // namespace k3
