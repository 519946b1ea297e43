// SlotTable: the request slots and KV pages of one rank, the one bookkeeping
// of both backends (the CPU Engine's Caches and the GpuRank's device pools).
//
// A slot holds one request: its committed length and, between a step and its
// commit, the width q of that step (pending). Pages hold page_size tokens of
// the full-attention caches; a page id is valid in every layer's pool, and
// each slot owns a block table (its page ids in order). With DCP (D ranks) a
// rank holds positions p with p mod D == dcp_rank at local index p / D, so a
// slot of `tokens` positions needs pages_for(local_tokens(tokens)) pages here:
// the pools of a DCP rank are 1/D of the context.
//
// Every check of a step's input (slots, q, token ids, context, pages) lives
// in validate_step() and raises an Error before anything is changed.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace k3 {

struct SlotTableOptions {
  int max_slots = 8;          // concurrent requests
  int64_t max_context = 512;  // tokens per request
  int max_q = 16;             // tokens per request per step
  int page_size = 16;         // tokens per KV page
  int64_t num_pages = 0;      // 0: enough for every slot at max_context
  int dcp_size = 1;           // this rank's share of the positions
  int dcp_rank = 0;
};

class SlotTable {
 public:
  explicit SlotTable(const SlotTableOptions& o);

  const SlotTableOptions& options() const { return o_; }
  int max_slots() const { return o_.max_slots; }
  int64_t num_pages() const { return o_.num_pages; }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  // Positions < tokens held by this DCP rank, and the pages they fill.
  int64_t local_tokens(int64_t tokens) const;
  int64_t pages_for(int64_t local) const { return (local + o_.page_size - 1) / o_.page_size; }
  // The longest block table a slot can have (the stride of the device tables).
  int64_t max_pages_per_slot() const { return pages_for(local_tokens(o_.max_context)); }

  // A free slot, with the pages of its first `reserve_tokens` positions set aside for it: a server admits a
  // request with its worst case (prompt + max_tokens) so that it never runs out of pages later. Error when every
  // slot is taken or the free pages that no other request has set aside are too few.
  int admit(int64_t reserve_tokens = 0);
  // Whether admit(reserve_tokens) would succeed now, and whether it could on an empty table.
  bool can_admit(int64_t reserve_tokens) const;
  bool fits(int64_t tokens) const;
  // Pages set aside by admitted requests and not yet held by them.
  int64_t reserved_pages() const;
  void release(int slot);
  void check_slot(int slot, const char* what) const;
  int64_t length(int slot) const;
  bool pending(int slot) const;
  int pending_q(int slot) const;  // the width of the slot's uncommitted step (0: none)
  const std::vector<int32_t>& pages(int slot) const { return slots_.at(slot).pages; }

  // The step's input, checked: B requests (>= 1, or >= 0 when an idle replica
  // may step), q in 1..max_q, B q token ids in 0..vocab-1, each slot listed
  // once, holding a request with no uncommitted step (unless `restep`: the
  // GPU rank may re-run a prepared step that was never committed), room in
  // the context and pages for the step.
  void validate_step(std::span<const int> slots, int q, std::span<const int32_t> tokens, int64_t vocab,
                     bool allow_empty, bool restep = false) const;
  // Reserves the step's pages and marks the slots pending; returns each
  // request's first position (its committed length). validate_step() first.
  std::vector<int64_t> begin_step(std::span<const int> slots, int q);
  // Accepts the first n of the pending step's q tokens: length += n, the
  // pages past the new length are released.
  void commit(int slot, int n);
  // Benchmarks: `length` cached tokens without running them (pages reserved).
  void set_length(int slot, int64_t length);

 private:
  struct Slot {
    bool active = false;
    int64_t length = 0;
    int pending_q = 0;
    int64_t reserved = 0;        // pages set aside at admission (held ones count against it)
    std::vector<int32_t> pages;  // block table: page ids of local positions [j ps, (j+1) ps)
  };
  void resize(Slot& s, int64_t tokens);  // the block table for positions < tokens

  SlotTableOptions o_;
  std::vector<Slot> slots_;
  std::vector<int32_t> free_;
};

}  // namespace k3
