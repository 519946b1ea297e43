// Caches (runtime/cache.h): the CPU engine's KDA states and paged latent / indexer pools.
#include "runtime/cache.h"

#include <algorithm>

#include "core/error.h"
#include "ops/kda.h"
#include "ops/short_conv.h"

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
  heads_ = kda_heads;
  head_dim_ = c.kda.head_dim;
  conv_kernel_ = c.kda.conv_kernel;
  kept_floats_ = 3 * H * d + H;
  cur_.assign(static_cast<size_t>(o.max_slots), 0);
  entry_ = c.mla.cache_dim();
  index_dim_ = c.dsa ? c.dsa->index_head_dim : 0;
  const int64_t S = o.max_slots, Q = o.max_q, tokens = opt_.num_pages * o.page_size;
  for (AttnKind k : c.attn_kinds) {
    if (k == AttnKind::KDA) {
      kda_index_.push_back(static_cast<int>(conv_.size()));
      full_index_.push_back(-1);
      conv_.emplace_back(S * 3 * conv_floats_, 0.0f);
      conv_x_.emplace_back(S * 3 * Q * H * d, 0.0f);
      state_.emplace_back(S * 2 * state_floats_, 0.0f);
      kept_.emplace_back(S * Q * kept_floats_, 0.0f);
    } else {
      kda_index_.push_back(-1);
      full_index_.push_back(static_cast<int>(kv_.size()));
      kv_.emplace_back(tokens * entry_, 0.0f);
      index_.emplace_back(tokens * index_dim_, 0.0f);
    }
  }
}

void Caches::reset_slot(int slot) {
  cur_.at(slot) = 0;
  for (size_t i = 0; i < conv_.size(); ++i) {
    std::fill_n(conv_[i].begin() + slot * 3 * conv_floats_, 3 * conv_floats_, 0.0f);
    std::fill_n(state_[i].begin() + slot * 2 * state_floats_, state_floats_, 0.0f);
  }
}

void Caches::commit_kda(int slot, int n, int q) {
  K3_CHECK(n >= 0 && n <= q && q <= opt_.max_q, "internal: commit of {} tokens of a step of {}", n, q);
  if (n == 0) return;
  const int64_t Q = opt_.max_q, Ch = int64_t{heads_} * head_dim_;
  const int cur = cur_.at(slot);
  for (size_t i = 0; i < conv_.size(); ++i) {
    for (int j = 0; j < 3; ++j)
      ops::short_conv_advance(&conv_x_[i][(slot * 3 + j) * Q * Ch], &conv_[i][(slot * 3 + j) * conv_floats_], n, Ch,
                              conv_kernel_);
    if (n == q) continue;  // the step's state is in the other buffer already
    const float* from = &state_[i][(slot * 2 + cur) * state_floats_];
    float* to = &state_[i][(slot * 2 + 1 - cur) * state_floats_];
    std::copy(from, from + state_floats_, to);
    const float* kept = &kept_[i][slot * Q * kept_floats_];
    ops::kda_replay(kept, kept + 2 * Q * Ch, kept + Q * Ch, kept + 3 * Q * Ch, to, n, heads_, head_dim_, head_dim_);
  }
  cur_[slot] = 1 - cur;
}

KdaSlotState Caches::kda(int layer, int b) {
  const int i = kda_index_.at(layer);
  K3_CHECK(i >= 0, "internal: layer {} is not a KDA layer", layer);
  const int64_t slot = bound_.at(b), Q = opt_.max_q;
  const int64_t Ch = int64_t{heads_} * head_dim_;
  const int cur = cur_.at(slot);
  KdaSlotState s;
  for (int j = 0; j < 3; ++j) {
    s.conv[j] = &conv_[i][(slot * 3 + j) * conv_floats_];
    s.conv_x[j] = &conv_x_[i][(slot * 3 + j) * Q * Ch];
  }
  s.S = &state_[i][(slot * 2 + cur) * state_floats_];
  s.S_next = &state_[i][(slot * 2 + 1 - cur) * state_floats_];
  float* kept = &kept_[i][slot * Q * kept_floats_];
  s.kept_k = kept;
  s.kept_g = kept + Q * Ch;
  s.kept_v = kept + 2 * Q * Ch;
  s.kept_beta = kept + 3 * Q * Ch;
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
