// Per-request caches of one rank, sized once from the config and capacities.
//
// KDA (every KDA layer, every request slot): committed conv states (q, k, v:
// [C, K-1] each, the last K-1 inputs) and two recurrent state buffers [H, d, d]
// F32, one of them current (a per-slot index shared by all layers). A step
// never writes the committed states: it writes the recurrent state after its
// last token into the other buffer and keeps its per-token inputs (pre-conv
// q, k, v [max_q, C]; the recurrence's k, g, v [max_q, H, d] and beta
// [max_q, H]). commit(n) of a q-token step: the conv states advance by the n
// accepted inputs; n == q flips the current buffer, 0 < n < q replays the
// recurrence over the n kept tokens into the other buffer (bit-identical to a
// step of those n tokens) and flips, n == 0 leaves everything. The committed
// state is the state of decoding exactly the accepted tokens; rejected drafts
// vanish.
//
// MLA / DSA (every full-attention layer): a paged latent cache of R + P values
// per token and, for DSA, the indexer key (Di values) per token. Pages hold
// page_size tokens and are shared by all layers (page id p is the same page in
// every layer's pool); each slot owns a block table. Entries past a request's
// committed length are scratch: a verify step writes its draft tokens there and
// a later step overwrites the rejected ones.
//
// On a rank of a TP group the KDA states hold the rank's heads only; with DCP
// (D ranks) the latent cache holds positions p with p mod D == dcp rank, at
// local index p / D.
#pragma once

#include <cstdint>
#include <vector>

#include "config/model_config.h"
#include "model/layers.h"
#include "runtime/slot_table.h"

namespace k3 {

struct CacheOptions {
  int max_slots = 8;           // concurrent requests
  int64_t max_context = 512;   // tokens per request
  int max_q = 16;              // tokens per request per step (verify width / prefill chunk)
  int page_size = 16;          // tokens per KV page
  int64_t num_pages = 0;       // 0: enough for every slot at max_context
};

class Caches : public AttentionCache {
 public:
  // kda_heads: this rank's KDA heads; dcp_size / dcp_rank: its share of the positions.
  Caches(const ModelConfig& c, const CacheOptions& o, int kda_heads, int dcp_size = 1, int dcp_rank = 0);

  const CacheOptions& options() const { return opt_; }
  // The slots and pages (runtime/slot_table.h): the Engine admits, steps and commits through it.
  SlotTable& table() { return table_; }
  const SlotTable& table() const { return table_; }

  void reset_slot(int slot);                // zero the slot's committed KDA states
  void commit_kda(int slot, int n, int q);  // keep n of the pending step's q tokens (see above)

  // Binds the step's request b to slot slots[b] (AttentionCache's view).
  void bind(const std::vector<int>& slots) { bound_ = slots; }
  KdaSlotState kda(int layer, int b) override;
  float* kv_entry(int layer, int b, int64_t pos) override;
  float* index_key(int layer, int b, int64_t pos) override;

 private:
  float* page_row(std::vector<float>& pool, int slot, int64_t pos, int64_t width);

  CacheOptions opt_;
  SlotTable table_;
  int64_t conv_floats_ = 0;   // C * (K - 1)
  int64_t state_floats_ = 0;  // H * d * d
  int64_t entry_ = 0;         // R + P
  int64_t index_dim_ = 0;     // Di (0 without DSA)
  int dcp_size_ = 1, dcp_rank_ = 0;
  std::vector<int> kda_index_, full_index_;  // layer -> index among its kind, or -1
  int64_t kept_floats_ = 0;   // per slot and token: k, g, v (3 C) + beta (H)
  int heads_ = 0, head_dim_ = 0, conv_kernel_ = 1;
  std::vector<std::vector<float>> conv_;     // [kda layer][slot, 3, C, K-1]
  std::vector<std::vector<float>> conv_x_;   // [kda layer][slot, 3, max_q, C]: pre-conv inputs
  std::vector<std::vector<float>> state_;    // [kda layer][slot, 2, H, d, d]
  std::vector<std::vector<float>> kept_;     // [kda layer][slot, max_q, 3 C + H]: k, g, v, beta
  std::vector<int> cur_;                     // [slot]: the current state buffer (0 / 1)
  std::vector<std::vector<float>> kv_;       // [full layer][page, page_size, R + P]
  std::vector<std::vector<float>> index_;    // [full layer][page, page_size, Di]
  std::vector<int> bound_;
};

}  // namespace k3
