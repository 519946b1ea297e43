// GpuCaches (runtime/gpu/caches.h).
#include "runtime/gpu/caches.h"

#include "ops/kda.h"

namespace k3 {

namespace cu = ops::cuda;

GpuCaches::GpuCaches(const ModelConfig& c, int kda_heads, int max_slots, int max_q, int64_t num_pages,
                     int page_size)
    : max_slots_(max_slots), max_q_(max_q) {
  const int64_t S = max_slots, Q = max_q, d = c.kda.head_dim, C = int64_t{kda_heads} * d;
  const int64_t tokens = num_pages * page_size, E = c.mla.cache_dim();
  conv_floats_ = C * (c.kda.conv_kernel - 1);
  state_floats_ = C * d;
  auto zeroed = [&](size_t bytes) {
    DeviceBuffer b(bytes);
    CUDA_CHECK(cudaMemset(b.get(), 0, bytes));
    bytes_ += bytes;
    return b;
  };
  for (AttnKind k : c.attn_kinds) {
    if (k == AttnKind::KDA) {
      kda_index_.push_back(static_cast<int>(state_.size()));
      full_index_.push_back(-1);
      for (int j = 0; j < 3; ++j) {
        conv_.push_back(zeroed(S * conv_floats_ * 4));
        conv_hist_.push_back(zeroed(S * Q * conv_floats_ * 4));
      }
      state_.push_back(zeroed(S * state_floats_ * 4));
      state_hist_.push_back(zeroed(S * Q * state_floats_ * 4));
    } else {
      kda_index_.push_back(-1);
      full_index_.push_back(static_cast<int>(kv_.size()));
      kv_.push_back(zeroed(tokens * E * 2));
      index_.push_back(zeroed(c.dsa ? tokens * c.dsa->index_head_dim * 2 : 0));
    }
  }
}

void GpuCaches::reset_slot(int slot, CUstream_st* s) {
  for (auto& b : conv_)
    CUDA_CHECK(cudaMemsetAsync(b.get<float>() + slot * conv_floats_, 0, conv_floats_ * 4, s));
  for (auto& b : state_)
    CUDA_CHECK(cudaMemsetAsync(b.get<float>() + slot * state_floats_, 0, state_floats_ * 4, s));
}

void GpuCaches::commit(const int32_t* d_slots, const int32_t* d_accepted, int B, CUstream_st* s) {
  for (size_t i = 0; i < state_.size(); ++i) {
    for (int j = 0; j < 3; ++j)
      CUDA_CHECK(static_cast<cudaError_t>(cu::commit_state(conv_hist_[3 * i + j].get<float>(),
                                                           conv_[3 * i + j].get<float>(), d_slots, d_accepted, B,
                                                           max_q_, conv_floats_, s)));
    CUDA_CHECK(static_cast<cudaError_t>(cu::commit_state(state_hist_[i].get<float>(), state_[i].get<float>(), d_slots,
                                                         d_accepted, B, max_q_, state_floats_, s)));
  }
}

std::vector<GpuCaches::Pool> GpuCaches::pools() {
  std::vector<Pool> out;
  for (auto* v : {&conv_, &state_, &kv_, &index_})
    for (auto& b : *v)
      if (b.bytes()) out.push_back({b.get(), b.bytes(), v == &conv_ || v == &state_});
  return out;
}

}  // namespace k3
