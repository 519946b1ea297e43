// GpuCaches (runtime/gpu/caches.h).
#include "runtime/gpu/caches.h"

#include "ops/kda.h"
#include "ops/short_conv.h"

namespace k3 {

namespace cu = ops::cuda;

GpuCaches::GpuCaches(const ModelConfig& c, int kda_heads, int max_slots, int max_q, int64_t num_pages,
                     int page_size)
    : max_slots_(max_slots),
      max_q_(max_q),
      heads_(kda_heads),
      head_dim_(c.kda.head_dim),
      conv_kernel_(c.kda.conv_kernel),
      cur_(static_cast<size_t>(max_slots), 0) {
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
        conv_x_.push_back(zeroed(S * Q * C * 4));
      }
      state_.push_back(zeroed(S * 2 * state_floats_ * 4));
      kept_.push_back(zeroed(S * Q * (3 * C + kda_heads) * 4));
    } else {
      kda_index_.push_back(-1);
      full_index_.push_back(static_cast<int>(kv_.size()));
      kv_.push_back(zeroed(tokens * E * 2));
      index_.push_back(zeroed(c.dsa ? tokens * c.dsa->index_head_dim * 2 : 0));
    }
  }
}

void GpuCaches::reset_slot(int slot, CUstream_st* s) {
  cur_.at(slot) = 0;
  for (auto& b : conv_)
    CUDA_CHECK(cudaMemsetAsync(b.get<float>() + slot * conv_floats_, 0, conv_floats_ * 4, s));
  for (auto& b : state_)
    CUDA_CHECK(cudaMemsetAsync(b.get<float>() + int64_t{read_state(slot)} * state_floats_, 0, state_floats_ * 4, s));
}

ops::cuda::KdaKept GpuCaches::kept(int layer) {
  const int64_t n = int64_t{max_slots_} * max_q_ * heads_ * head_dim_;  // floats of k (and of g, v)
  float* base = kept_[kda_index_[layer]].get<float>();
  return {base, base + n, base + 2 * n, base + 3 * n};
}

void GpuCaches::commit(std::span<const int> slots, std::span<const int> accepted, int q, const int32_t* d_slots,
                       const int32_t* d_accepted, const int32_t* d_read, const int32_t* d_write, CUstream_st* s) {
  const int B = static_cast<int>(slots.size());
  bool any = false, partial = false;
  for (int b = 0; b < B; ++b) {
    any |= accepted[b] > 0;
    partial |= accepted[b] > 0 && accepted[b] < q;
  }
  if (!any) return;
  const int64_t C = int64_t{heads_} * head_dim_;
  for (size_t i = 0; i < state_.size(); ++i) {
    for (int j = 0; j < 3; ++j)
      CUDA_CHECK(static_cast<cudaError_t>(cu::short_conv_commit(conv_x_[3 * i + j].get<float>(),
                                                                conv_[3 * i + j].get<float>(), d_slots, d_accepted, B,
                                                                max_q_, C, conv_kernel_, s)));
    if (partial) {
      float* base = kept_[i].get<float>();
      const int64_t n = int64_t{max_slots_} * max_q_ * C;
      const cu::KdaKept kept{base, base + n, base + 2 * n, base + 3 * n};
      CUDA_CHECK(static_cast<cudaError_t>(cu::kda_replay(kept, state_[i].get<float>(), d_read, d_write, d_slots,
                                                         d_accepted, B, q, max_q_, heads_, head_dim_, head_dim_, s)));
    }
  }
  for (int b = 0; b < B; ++b)
    if (accepted[b] > 0) cur_.at(slots[b]) ^= 1;
}

std::vector<GpuCaches::Pool> GpuCaches::pools() {
  std::vector<Pool> out;
  for (auto* v : {&conv_, &state_, &kv_, &index_})
    for (auto& b : *v)
      if (b.bytes()) out.push_back({b.get(), b.bytes(), v == &conv_ || v == &state_});
  return out;
}

}  // namespace k3
