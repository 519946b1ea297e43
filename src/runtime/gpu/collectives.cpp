// GpuRank's collectives in their three modes (runtime/gpu/collectives.h).
#include "runtime/gpu/collectives.h"

#include <algorithm>

#include "core/cuda.h"

namespace k3 {

GpuCollectives::GpuCollectives(Mode mode, RankGroups* groups, int tp_size, int tp_rank, CUstream_st* stream)
    : mode_(mode), groups_(groups), G_(tp_size), t_(tp_rank), stream_(stream) {
  if (mode_ != Mode::Real) return;
  K3_CHECK(groups_ && groups_->tp && groups_->dcp && groups_->world, "gpu: real collectives need the rank's groups");
  K3_CHECK(groups_->tp->size() == G_ && groups_->tp->rank() == t_,
           "gpu: tp group of rank {} of {} for a shard of tp rank {} of {}", groups_->tp->rank(), groups_->tp->size(),
           t_, G_);
  for (Comm* c : {groups_->tp.get(), groups_->dcp.get(), groups_->world.get()}) c->set_stream(stream_);
}

bool GpuCollectives::capturable() const {
  if (mode_ != Mode::Real) return true;
  return groups_->tp->capturable() && groups_->dcp->capturable() && groups_->world->capturable();
}

void GpuCollectives::tp_all_reduce(bf16* data, int64_t n, bf16* scratch) {
  if (G_ == 1 || mode_ == Mode::Single) return;
  if (mode_ == Mode::Real) {
    groups_->tp->all_reduce(data, n, DType::BF16);
    return;
  }
  CUDA_CHECK(cudaMemcpyAsync(scratch, data, n * 2, cudaMemcpyDeviceToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(scratch, data, n * 2, cudaMemcpyDeviceToDevice, stream_));
}

void GpuCollectives::tp_all_gather_rows(const bf16* shard, bf16* all, int64_t m, int64_t D) {
  const int64_t c = (m + G_ - 1) / G_;
  if (mode_ == Mode::Real) {
    if (G_ == 1) {
      if (all != shard) CUDA_CHECK(cudaMemcpyAsync(all, shard, m * D * 2, cudaMemcpyDeviceToDevice, stream_));
      return;
    }
    groups_->tp->all_gather(shard, all, c * D, DType::BF16);
    return;
  }
  // Loopback: the shard, then the filled prefix doubled (log2 G copies of the same bytes as G copies).
  if (m == 0) return;
  const int64_t first = std::min(m, c);
  if (all != shard) CUDA_CHECK(cudaMemcpyAsync(all, shard, first * D * 2, cudaMemcpyDeviceToDevice, stream_));
  replicate_rows(all, first, m, D);
}

void GpuCollectives::replicate_rows(bf16* buf, int64_t filled, int64_t total, int64_t D) {
  while (filled > 0 && filled < total) {
    const int64_t n = std::min(filled, total - filled);
    CUDA_CHECK(cudaMemcpyAsync(buf + filled * D, buf, n * D * 2, cudaMemcpyDeviceToDevice, stream_));
    filled += n;
  }
}

void GpuCollectives::tp_reduce_scatter_rows(const bf16* partial, bf16* shard, int64_t m, int64_t D, bf16* scratch) {
  const int64_t c = (m + G_ - 1) / G_;
  if (mode_ == Mode::Real && G_ > 1) {
    groups_->tp->reduce_scatter(partial, shard, c * D, DType::BF16);
    return;
  }
  const int64_t r0 = std::min(m, t_ * c), real = std::min(m, r0 + c) - r0;
  if (real > 0) CUDA_CHECK(cudaMemcpyAsync(shard, partial + r0 * D, real * D * 2, cudaMemcpyDeviceToDevice, stream_));
  if (mode_ == Mode::Loopback)
    for (int g = 1; g < G_; ++g)
      CUDA_CHECK(cudaMemcpyAsync(scratch, partial, c * D * 2, cudaMemcpyDeviceToDevice, stream_));
}

void GpuCollectives::vocab_all_gather(float* slices, int64_t m, int64_t Vl, float* logits) {
  const int64_t V = G_ * Vl;
  float* mine = slices + t_ * m * Vl;
  if (mode_ == Mode::Real && G_ > 1) groups_->tp->all_gather(mine, slices, m * Vl, DType::F32);
  for (int g = 0; g < G_; ++g) {
    const float* src = mode_ == Mode::Real ? slices + g * m * Vl : mine;
    CUDA_CHECK(cudaMemcpy2DAsync(logits + g * Vl, V * 4, src, Vl * 4, Vl * 4, m, cudaMemcpyDeviceToDevice, stream_));
  }
}

void GpuCollectives::ep_loopback_dispatch(const bf16* z, bf16* exchange, int64_t n_in, int64_t n_out) {
  K3_CHECK(mode_ == Mode::Loopback, "internal: the loopback EP exchange outside loopback mode");
  CUDA_CHECK(cudaMemcpyAsync(exchange, z, std::min(n_in, n_out) * 2, cudaMemcpyDeviceToDevice, stream_));
  replicate_rows(exchange, std::min(n_in, n_out), n_out, 1);
}

void GpuCollectives::dcp_all_gather(const void* send, void* recv, int64_t count, DType dt) {
  K3_CHECK(real(), "internal: dcp collectives need real collectives");
  groups_->dcp->all_gather(send, recv, count, dt);
}

void GpuCollectives::all_to_all(Comm& c, const void* send, void* recv, int64_t count, DType dt) {
  counts_.assign(static_cast<size_t>(c.size()), count);
  c.all_to_all_v(send, counts_.data(), recv, counts_.data(), dt);
}

void GpuCollectives::dcp_all_to_all(const void* send, void* recv, int64_t count, DType dt) {
  K3_CHECK(real(), "internal: dcp collectives need real collectives");
  all_to_all(*groups_->dcp, send, recv, count, dt);
}

void GpuCollectives::world_all_to_all(const void* send, void* recv, int64_t count, DType dt) {
  K3_CHECK(real(), "internal: the EP exchange needs real collectives");
  all_to_all(*groups_->world, send, recv, count, dt);
}

}  // namespace k3
