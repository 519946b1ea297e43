#include "runtime/engine.h"

#include <algorithm>

#include "model/layers.h"

namespace k3 {

Engine::Engine(std::shared_ptr<const TensorSource> src, const ModelConfig& config, const CacheOptions& options)
    : src_(std::move(src)), config_(config), weights_(load_weights(config_, *src_)), caches_(config_, options) {
  slots_.resize(static_cast<size_t>(caches_.options().max_slots));
}

void Engine::check_slot(int slot, const char* what) const {
  K3_CHECK(slot >= 0 && slot < static_cast<int>(slots_.size()), "{}: slot {} does not exist (0..{})", what, slot,
           slots_.size() - 1);
  K3_CHECK(slots_[slot].active, "{}: slot {} holds no request", what, slot);
}

int Engine::admit() {
  for (int s = 0; s < static_cast<int>(slots_.size()); ++s) {
    if (slots_[s].active) continue;
    caches_.reset_slot(s);
    slots_[s] = Slot{true, 0, 0};
    return s;
  }
  fail("admit: too many requests: all {} slots are in use", slots_.size());
}

void Engine::release(int slot) {
  check_slot(slot, "release");
  caches_.reset_slot(slot);
  slots_[slot] = Slot{};
}

int64_t Engine::length(int slot) const {
  check_slot(slot, "length");
  return slots_[slot].length;
}

bool Engine::pending(int slot) const {
  check_slot(slot, "pending");
  return slots_[slot].pending_q > 0;
}

std::vector<float> Engine::step(std::span<const int> slots, int q, std::span<const int32_t> tokens) {
  const auto& o = caches_.options();
  const int B = static_cast<int>(slots.size());
  K3_CHECK(B >= 1, "step: no requests");
  K3_CHECK(q >= 1 && q <= o.max_q, "step: q = {} outside 1..{} (max_q)", q, o.max_q);
  K3_CHECK(static_cast<int64_t>(tokens.size()) == int64_t{B} * q, "step: {} tokens for {} requests x q = {}",
           tokens.size(), B, q);
  int64_t new_pages = 0;
  for (int b = 0; b < B; ++b) {
    check_slot(slots[b], "step");
    K3_CHECK(std::count(slots.begin(), slots.end(), slots[b]) == 1, "step: slot {} listed twice", slots[b]);
    const Slot& s = slots_[slots[b]];
    K3_CHECK(s.pending_q == 0, "step: slot {} has an uncommitted step (commit it first)", slots[b]);
    K3_CHECK(s.length + q <= o.max_context, "step: slot {} is full: {} + {} tokens exceed the cache of {} tokens",
             slots[b], s.length, q, o.max_context);
    new_pages += std::max<int64_t>(0, caches_.pages_for(s.length + q) - caches_.pages_for(s.length));
  }
  for (size_t i = 0; i < tokens.size(); ++i)
    K3_CHECK(tokens[i] >= 0 && tokens[i] < config_.vocab_size, "step: token id {} (row {}) outside vocab 0..{}",
             tokens[i], i, config_.vocab_size - 1);
  K3_CHECK(new_pages <= caches_.free_pages(), "step: out of KV pages ({} free, {} needed)", caches_.free_pages(),
           new_pages);

  StepShape shape;
  shape.B = B;
  shape.q = q;
  std::vector<int> bound(slots.begin(), slots.end());
  for (int b = 0; b < B; ++b) {
    Slot& s = slots_[slots[b]];
    caches_.reserve(slots[b], s.length + q);
    shape.pos0.push_back(s.length);
    s.pending_q = q;
  }
  caches_.bind(bound);
  std::vector<float> logits(static_cast<size_t>(shape.rows() * config_.vocab_size));
  decode_forward(config_, weights_, tokens.data(), shape, caches_, logits.data());
  return logits;
}

void Engine::commit(int slot, int n) {
  check_slot(slot, "commit");
  Slot& s = slots_[slot];
  K3_CHECK(s.pending_q > 0, "commit: slot {} has no pending step", slot);
  K3_CHECK(n >= 0 && n <= s.pending_q, "commit: {} tokens accepted of a step of {}", n, s.pending_q);
  if (n > 0) caches_.commit_kda(slot, n);
  s.length += n;
  s.pending_q = 0;
  caches_.shrink(slot, s.length);
}

std::vector<float> Engine::prefill(int slot, std::span<const int32_t> prompt) {
  check_slot(slot, "prefill");
  const auto& o = caches_.options();
  K3_CHECK(!prompt.empty(), "prefill: empty prompt");
  K3_CHECK(slots_[slot].length + static_cast<int64_t>(prompt.size()) <= o.max_context,
           "prefill: prompt of {} tokens exceeds the cache of {} tokens", prompt.size(), o.max_context);
  for (size_t i = 0; i < prompt.size(); ++i)
    K3_CHECK(prompt[i] >= 0 && prompt[i] < config_.vocab_size, "prefill: token id {} (position {}) outside vocab 0..{}",
             prompt[i], i, config_.vocab_size - 1);
  std::vector<float> all;
  all.reserve(prompt.size() * static_cast<size_t>(config_.vocab_size));
  for (size_t at = 0; at < prompt.size(); at += static_cast<size_t>(o.max_q)) {
    const int q = static_cast<int>(std::min<size_t>(static_cast<size_t>(o.max_q), prompt.size() - at));
    const int slots[1] = {slot};
    auto logits = step(slots, q, prompt.subspan(at, static_cast<size_t>(q)));
    commit(slot, q);
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

}  // namespace k3
