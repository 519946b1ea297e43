// Caches (runtime/cache.h): the CPU engine's KDA states and paged latent / indexer pools.
#include "runtime/cache.h"

#include <algorithm>

#include "core/error.h"

namespace k3 {

namespace {
SlotTableOptions table_options(const CacheOptions& o, int dcp_size, int dcp_rank) {
  return {o.max_slots, o.max_context, o.max_q, o.page_size, o.num_pages, dcp_size, dcp_rank};
}
}  // namespace

Caches::Caches(const ModelConfig& c, const CacheOptions& o, int kda_heads, int dcp_size, int dcp_rank)
    : opt_(o), table_(table_options(o, dcp_size, dcp_rank)), dcp_size_(dcp_size), dcp_rank_(dcp_rank) {
  opt_.num_pages = table_.num_pages();
  const int64_t H = kda_heads, d = c.kda.head_dim;
  conv_floats_ = H * d * (c.kda.conv_kernel - 1);
  state_floats_ = H * d * d;
  entry_ = c.mla.cache_dim();
  index_dim_ = c.dsa ? c.dsa->index_head_dim : 0;
  const int64_t S = o.max_slots, Q = o.max_q, tokens = opt_.num_pages * o.page_size;
  for (AttnKind k : c.attn_kinds) {
    if (k == AttnKind::KDA) {
      kda_index_.push_back(static_cast<int>(conv_.size()));
      full_index_.push_back(-1);
      conv_.emplace_back(S * 3 * conv_floats_, 0.0f);
      conv_hist_.emplace_back(S * 3 * Q * conv_floats_, 0.0f);
      state_.emplace_back(S * state_floats_, 0.0f);
      state_hist_.emplace_back(S * Q * state_floats_, 0.0f);
    } else {
      kda_index_.push_back(-1);
      full_index_.push_back(static_cast<int>(kv_.size()));
      kv_.emplace_back(tokens * entry_, 0.0f);
      index_.emplace_back(tokens * index_dim_, 0.0f);
    }
  }
}

void Caches::reset_slot(int slot) {
  for (size_t i = 0; i < conv_.size(); ++i) {
    std::fill_n(conv_[i].begin() + slot * 3 * conv_floats_, 3 * conv_floats_, 0.0f);
    std::fill_n(state_[i].begin() + slot * state_floats_, state_floats_, 0.0f);
  }
}

void Caches::commit_kda(int slot, int n) {
  const int64_t Q = opt_.max_q;
  for (size_t i = 0; i < conv_.size(); ++i) {
    for (int j = 0; j < 3; ++j) {
      const float* src = &conv_hist_[i][((slot * 3 + j) * Q + (n - 1)) * conv_floats_];
      std::copy(src, src + conv_floats_, &conv_[i][(slot * 3 + j) * conv_floats_]);
    }
    const float* src = &state_hist_[i][(slot * Q + (n - 1)) * state_floats_];
    std::copy(src, src + state_floats_, &state_[i][slot * state_floats_]);
  }
}

KdaSlotState Caches::kda(int layer, int b) {
  const int i = kda_index_.at(layer);
  K3_CHECK(i >= 0, "internal: layer {} is not a KDA layer", layer);
  const int64_t slot = bound_.at(b), Q = opt_.max_q;
  KdaSlotState s;
  for (int j = 0; j < 3; ++j) {
    s.conv[j] = &conv_[i][(slot * 3 + j) * conv_floats_];
    s.conv_hist[j] = &conv_hist_[i][(slot * 3 + j) * Q * conv_floats_];
  }
  s.S = &state_[i][slot * state_floats_];
  s.S_hist = &state_hist_[i][slot * Q * state_floats_];
  return s;
}

float* Caches::page_row(std::vector<float>& pool, int slot, int64_t pos, int64_t width) {
  const auto& t = table_.pages(slot);
  K3_CHECK(pos >= 0 && pos % dcp_size_ == dcp_rank_, "internal: position {} is not held by DCP rank {} of {}", pos,
           dcp_rank_, dcp_size_);
  const int64_t local = pos / dcp_size_, page = local / opt_.page_size;
  K3_CHECK(page < static_cast<int64_t>(t.size()), "internal: position {} outside slot {}'s {} pages", pos, slot,
           t.size());
  return &pool[(static_cast<int64_t>(t[page]) * opt_.page_size + local % opt_.page_size) * width];
}

float* Caches::kv_entry(int layer, int b, int64_t pos) {
  const int i = full_index_.at(layer);
  K3_CHECK(i >= 0, "internal: layer {} is not a full-attention layer", layer);
  return page_row(kv_[i], bound_.at(b), pos, entry_);
}

float* Caches::index_key(int layer, int b, int64_t pos) {
  const int i = full_index_.at(layer);
  K3_CHECK(i >= 0 && index_dim_ > 0, "internal: layer {} has no indexer keys", layer);
  return page_row(index_[i], bound_.at(b), pos, index_dim_);
}

}  // namespace k3
