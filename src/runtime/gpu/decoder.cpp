// GpuDecoder (runtime/gpu/decoder.h).
#include "runtime/gpu/decoder.h"

namespace k3 {

GpuDecoder::GpuDecoder(const TensorSource& src, const ModelConfig& config, const GpuRankOptions& options)
    : config_(config), options_(options) {
  K3_CHECK(options.shard.tp_size == 1 && options.shard.world_size == 1 && !options.loopback,
           "gpu generate: one rank holds the whole model (tp = dp = 1)");
  ctx_ = std::make_unique<ops::cuda::ScopedContext>();
  options_.shard.ffn_tp = options.steps.shared == SharedExperts::Tp;
  owned_ = std::make_unique<GpuRank>(config, load_gpu_weights(src, config, options_.shard), options_, ctx_->get());
  rank_ = owned_.get();
}

GpuDecoder::GpuDecoder(GpuRank& rank, const ModelConfig& config, const GpuRankOptions& options, const Layout& layout,
                       int world_rank, Comm& world, bool graphs)
    : config_(config),
      options_(options),
      layout_(layout),
      world_rank_(world_rank),
      world_(&world),
      graphs_(graphs),
      rank_(&rank) {
  K3_CHECK(world.size() == layout.world() && world.rank() == world_rank,
           "gpu generate: world comm rank {} of {} for world rank {} of {}", world.rank(), world.size(), world_rank,
           layout.world());
}

GpuDecoder::~GpuDecoder() {
  owned_.reset();  // before the context it runs on
}

void GpuDecoder::run(std::span<const int> slots, int q, std::span<const int32_t> tokens) {
  rank_->prepare(slots, q, tokens);  // validates before anything is written
  // Every rank of a replica sees the same rows, so every rank takes the same step.
  last_step_ = choose_step(options_.steps, int64_t{static_cast<int64_t>(slots.size())} * q, q, layout_.tp);
  if (graphs_)
    rank_->run_graph(last_step_);
  else
    rank_->enqueue(last_step_);
}

std::vector<float> GpuDecoder::step(std::span<const int> slots, int q, std::span<const int32_t> tokens) {
  run(slots, q, tokens);
  return rank_->logits();
}

std::vector<ops::SampleResult> GpuDecoder::step_sample(std::span<const int> slots, int q,
                                                       std::span<const int32_t> tokens,
                                                       std::span<const ops::SampleSpec> spec) {
  K3_CHECK(static_cast<int64_t>(spec.size()) == static_cast<int64_t>(slots.size()) * q,
           "step_sample: {} specs for {} requests x q = {}", spec.size(), slots.size(), q);
  ops::check_specs(spec.data(), static_cast<int64_t>(spec.size()), config_.vocab_size);  // before the step
  run(slots, q, tokens);
  return rank_->sample(spec);
}

void GpuDecoder::commit(std::span<const int> slots, int q) {
  const std::vector<int> accepted(slots.size(), q);
  rank_->commit(slots, accepted);
}

void GpuDecoder::commit(std::span<const int> slots, std::span<const int> counts) {
  rank_->commit(slots, counts);
}

void GpuDecoder::world_sum(float* data, int64_t n) {
  if (world_ == nullptr || layout_.world() == 1 || n == 0) return;
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  if (staging_.bytes() < bytes) staging_ = DeviceBuffer(bytes);  // between steps, not inside one
  cudaStream_t s = rank_->stream();
  CUDA_CHECK(cudaMemcpyAsync(staging_.get(), data, bytes, cudaMemcpyHostToDevice, s));
  world_->all_reduce(staging_.get(), n, DType::F32);
  CUDA_CHECK(cudaMemcpyAsync(data, staging_.get(), bytes, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace k3
