// GpuCaches: the device pools of one GpuRank's caches (the layout of
// runtime/cache.h, with BF16 latent entries), sized from the SlotTable:
//   KDA layer i: conv states [3][slots, C, K-1] F32 and their history
//     [3][slots, max_q, C, K-1]; recurrent state [slots, Hk, d, d] F32 and its
//     history [slots, max_q, Hk, d, d] (a step writes the history, commit
//     copies row n-1 over the committed state);
//   full-attention layer i: latent KV [num_pages, page_size, R + P] BF16 and
//     (DSA) indexer keys [num_pages, page_size, Di] BF16, pages shared by all
//     layers through the slots' block tables (with DCP, 1/D of the context).
#pragma once

#include <cstdint>
#include <vector>

#include "config/model_config.h"
#include "core/bf16.h"
#include "core/cuda.h"

struct CUstream_st;

namespace k3 {

class GpuCaches {
 public:
  GpuCaches(const ModelConfig& c, int kda_heads, int max_slots, int max_q, int64_t num_pages, int page_size);

  // Zeroes a slot's committed KDA states (a new request).
  void reset_slot(int slot, CUstream_st* s);
  // Each of the B slots d_slots[b] takes history row d_accepted[b] - 1 as its committed KDA state (0: unchanged).
  void commit(const int32_t* d_slots, const int32_t* d_accepted, int B, CUstream_st* s);

  float* conv(int layer, int j) { return conv_[3 * kda_index_[layer] + j].get<float>(); }
  float* conv_hist(int layer, int j) { return conv_hist_[3 * kda_index_[layer] + j].get<float>(); }
  float* state(int layer) { return state_[kda_index_[layer]].get<float>(); }
  float* state_hist(int layer) { return state_hist_[kda_index_[layer]].get<float>(); }
  bf16* kv(int layer) { return kv_[full_index_[layer]].get<bf16>(); }
  bf16* index_keys(int layer) { return index_[full_index_[layer]].get<bf16>(); }

  struct Pool {
    void* ptr;
    size_t bytes;
    bool f32;  // F32 (KDA states) or BF16 (latent cache, indexer keys)
  };
  std::vector<Pool> pools();  // the committed states and the KV pools (benchmarks fill them)
  size_t bytes() const { return bytes_; }

 private:
  int max_slots_, max_q_;
  int64_t conv_floats_, state_floats_;  // per slot: C (K-1), Hk d d
  std::vector<DeviceBuffer> conv_, conv_hist_, state_, state_hist_;  // per KDA layer: 3 convs, 3 hists, S, S hist
  std::vector<DeviceBuffer> kv_, index_;                              // per full-attention layer
  std::vector<int> kda_index_, full_index_;                          // layer -> index among its kind, or -1
  size_t bytes_ = 0;
};

}  // namespace k3
