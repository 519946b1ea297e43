// SlotTable (runtime/slot_table.h).
#include "runtime/slot_table.h"

#include <algorithm>

#include "core/error.h"

namespace k3 {

SlotTable::SlotTable(const SlotTableOptions& o) : o_(o) {
  K3_CHECK(o.max_slots >= 1, "cache: max_slots {} must be >= 1", o.max_slots);
  K3_CHECK(o.max_context >= 1, "cache: max_context {} must be >= 1", o.max_context);
  K3_CHECK(o.max_q >= 1, "cache: max_q {} must be >= 1", o.max_q);
  K3_CHECK(o.page_size >= 1, "cache: page_size {} must be >= 1", o.page_size);
  K3_CHECK(o.num_pages >= 0, "cache: num_pages {} must be >= 0", o.num_pages);
  K3_CHECK(o.dcp_size >= 1 && o.dcp_rank >= 0 && o.dcp_rank < o.dcp_size, "cache: dcp rank {} of {}", o.dcp_rank,
           o.dcp_size);
  if (o_.num_pages == 0) o_.num_pages = int64_t{o.max_slots} * max_pages_per_slot();
  K3_CHECK(o_.num_pages <= INT32_MAX, "cache: {} pages do not fit int32 page ids", o_.num_pages);
  slots_.resize(static_cast<size_t>(o.max_slots));
  for (int64_t p = o_.num_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

int64_t SlotTable::local_tokens(int64_t tokens) const {
  return tokens > o_.dcp_rank ? (tokens - o_.dcp_rank + o_.dcp_size - 1) / o_.dcp_size : 0;
}

int64_t SlotTable::reserved_pages() const {
  int64_t r = 0;
  for (const Slot& s : slots_)
    if (s.active) r += std::max<int64_t>(0, s.reserved - static_cast<int64_t>(s.pages.size()));
  return r;
}

bool SlotTable::fits(int64_t tokens) const {
  return tokens <= o_.max_context && pages_for(local_tokens(tokens)) <= o_.num_pages;
}

bool SlotTable::can_admit(int64_t reserve_tokens) const {
  const bool slot = std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return !s.active; });
  return slot && fits(reserve_tokens) &&
         pages_for(local_tokens(reserve_tokens)) <= free_pages() - reserved_pages();
}

int SlotTable::admit(int64_t reserve_tokens) {
  K3_CHECK(reserve_tokens >= 0 && reserve_tokens <= o_.max_context,
           "admit: {} tokens to set aside, outside 0..{} (the context)", reserve_tokens, o_.max_context);
  const int64_t want = pages_for(local_tokens(reserve_tokens)), spare = free_pages() - reserved_pages();
  K3_CHECK(want <= spare, "admit: out of KV pages: {} needed, {} free of which {} are set aside for other requests",
           want, free_pages(), free_pages() - spare);
  for (int s = 0; s < o_.max_slots; ++s) {
    if (slots_[s].active) continue;
    slots_[s] = Slot{};
    slots_[s].active = true;
    slots_[s].reserved = want;
    return s;
  }
  fail("admit: too many requests: all {} slots are in use", o_.max_slots);
}

void SlotTable::check_slot(int slot, const char* what) const {
  K3_CHECK(slot >= 0 && slot < o_.max_slots, "{}: slot {} does not exist (0..{})", what, slot, o_.max_slots - 1);
  K3_CHECK(slots_[slot].active, "{}: slot {} holds no request", what, slot);
}

void SlotTable::release(int slot) {
  check_slot(slot, "release");
  resize(slots_[slot], 0);
  slots_[slot] = Slot{};
}

int64_t SlotTable::length(int slot) const {
  check_slot(slot, "length");
  return slots_[slot].length;
}

bool SlotTable::pending(int slot) const {
  check_slot(slot, "pending");
  return slots_[slot].pending_q > 0;
}

int SlotTable::pending_q(int slot) const {
  check_slot(slot, "pending");
  return slots_[slot].pending_q;
}

void SlotTable::validate_step(std::span<const int> slots, int q, std::span<const int32_t> tokens, int64_t vocab,
                              bool allow_empty, bool restep) const {
  const int B = static_cast<int>(slots.size());
  K3_CHECK(B >= 1 || allow_empty, "step: no requests");
  K3_CHECK(B <= o_.max_slots, "step: {} requests for {} slots", B, o_.max_slots);
  K3_CHECK(q >= 1 && q <= o_.max_q, "step: q = {} outside 1..{} (max_q)", q, o_.max_q);
  K3_CHECK(static_cast<int64_t>(tokens.size()) == int64_t{B} * q, "step: {} tokens for {} requests x q = {}",
           tokens.size(), B, q);
  int64_t new_pages = 0, reserved_after = reserved_pages();
  for (int b = 0; b < B; ++b) {
    check_slot(slots[b], "step");
    K3_CHECK(std::count(slots.begin(), slots.end(), slots[b]) == 1, "step: slot {} listed twice", slots[b]);
    const Slot& s = slots_[slots[b]];
    K3_CHECK(restep || s.pending_q == 0, "step: slot {} has an uncommitted step (commit it first)", slots[b]);
    K3_CHECK(s.length + q <= o_.max_context, "step: slot {} is full: {} + {} tokens exceed the cache of {} tokens",
             slots[b], s.length, q, o_.max_context);
    const int64_t held = static_cast<int64_t>(s.pages.size()), after = std::max(held, pages_for(local_tokens(s.length + q)));
    new_pages += after - held;
    reserved_after += std::max<int64_t>(0, s.reserved - after) - std::max<int64_t>(0, s.reserved - held);
  }
  for (size_t i = 0; i < tokens.size(); ++i)
    K3_CHECK(tokens[i] >= 0 && tokens[i] < vocab, "step: token id {} (row {}) outside vocab 0..{}", tokens[i], i,
             vocab - 1);
  // A slot grows into its own reserve first; what the others set aside stays free.
  K3_CHECK(new_pages <= free_pages() - reserved_after,
           "step: out of KV pages ({} free, {} set aside for admitted requests, {} needed)", free_pages(),
           reserved_after, new_pages);
}

std::vector<int64_t> SlotTable::begin_step(std::span<const int> slots, int q) {
  std::vector<int64_t> pos0;
  pos0.reserve(slots.size());
  for (int slot : slots) {
    Slot& s = slots_.at(slot);
    resize(s, s.length + q);
    s.pending_q = q;
    pos0.push_back(s.length);
  }
  return pos0;
}

void SlotTable::commit(int slot, int n) {
  check_slot(slot, "commit");
  Slot& s = slots_[slot];
  K3_CHECK(s.pending_q > 0, "commit: slot {} has no pending step", slot);
  K3_CHECK(n >= 0 && n <= s.pending_q, "commit: {} tokens accepted of a step of {}", n, s.pending_q);
  s.length += n;
  s.pending_q = 0;
  resize(s, s.length);
}

void SlotTable::set_length(int slot, int64_t length) {
  check_slot(slot, "set_length");
  K3_CHECK(length >= 0 && length <= o_.max_context, "context {} outside 0..{}", length, o_.max_context);
  Slot& s = slots_[slot];
  const int64_t need = pages_for(local_tokens(length)) - static_cast<int64_t>(s.pages.size());
  K3_CHECK(need <= free_pages(), "out of KV pages ({} free, {} needed)", free_pages(), need);
  resize(s, length);
  s.length = length;
  s.pending_q = 0;
}

void SlotTable::resize(Slot& s, int64_t tokens) {
  const auto need = static_cast<size_t>(pages_for(local_tokens(tokens)));
  while (s.pages.size() > need) {
    free_.push_back(s.pages.back());
    s.pages.pop_back();
  }
  while (s.pages.size() < need) {
    K3_CHECK(!free_.empty(), "internal: out of KV pages after validation");
    s.pages.push_back(free_.back());
    free_.pop_back();
  }
}

}  // namespace k3
