#include "runtime/cache.h"

#include <algorithm>

#include "core/error.h"

namespace k3 {

Caches::Caches(const ModelConfig& c, const CacheOptions& o, int kda_heads, int dcp_size, int dcp_rank)
    : opt_(o), dcp_size_(dcp_size), dcp_rank_(dcp_rank) {
  K3_CHECK(o.max_slots >= 1, "cache: max_slots {} must be >= 1", o.max_slots);
  K3_CHECK(o.max_context >= 1, "cache: max_context {} must be >= 1", o.max_context);
  K3_CHECK(o.max_q >= 1, "cache: max_q {} must be >= 1", o.max_q);
  K3_CHECK(o.page_size >= 1, "cache: page_size {} must be >= 1", o.page_size);
  if (opt_.num_pages == 0) opt_.num_pages = int64_t{o.max_slots} * pages_for(local_tokens(o.max_context));
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
  tables_.resize(static_cast<size_t>(S));
  for (int64_t p = opt_.num_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

void Caches::reset_slot(int slot) {
  for (size_t i = 0; i < conv_.size(); ++i) {
    std::fill_n(conv_[i].begin() + slot * 3 * conv_floats_, 3 * conv_floats_, 0.0f);
    std::fill_n(state_[i].begin() + slot * state_floats_, state_floats_, 0.0f);
  }
  shrink(slot, 0);
}

int64_t Caches::local_tokens(int64_t tokens) const {
  return tokens > dcp_rank_ ? (tokens - dcp_rank_ + dcp_size_ - 1) / dcp_size_ : 0;
}

void Caches::reserve(int slot, int64_t tokens) {
  auto& t = tables_[slot];
  const int64_t need = pages_for(local_tokens(tokens));
  K3_CHECK(need - static_cast<int64_t>(t.size()) <= free_pages(), "cache: out of KV pages ({} free, {} needed)",
           free_pages(), need - static_cast<int64_t>(t.size()));
  while (static_cast<int64_t>(t.size()) < need) {
    t.push_back(free_.back());
    free_.pop_back();
  }
}

void Caches::shrink(int slot, int64_t tokens) {
  auto& t = tables_[slot];
  const int64_t keep = pages_for(local_tokens(tokens));
  while (static_cast<int64_t>(t.size()) > keep) {
    free_.push_back(t.back());
    t.pop_back();
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
  const auto& t = tables_[slot];
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
