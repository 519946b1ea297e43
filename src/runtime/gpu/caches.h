// GpuCaches: the device pools of one GpuRank's caches (the layout of
// runtime/cache.h, with BF16 latent entries), sized from the SlotTable:
//   KDA layer i: conv states [3][slots, C, K-1] F32 and the step's pre-conv
//     inputs [3][slots, max_q, C] F32; two recurrent states per slot
//     [slots, 2, Hk, d, d] F32, one current (a host-side index per slot shared
//     by all layers: read_state / write_state, uploaded with each step), and the
//     step's kept recurrence inputs (ops::cuda::KdaKept: k, g, v, beta per
//     slot and token). A step reads the current state and writes the state
//     after its last token into the other one; commit(n) advances the conv
//     states by the n accepted inputs and flips (n == q), or replays the n
//     kept tokens into the other state and flips (0 < n < q), or keeps all (n == 0);
//   full-attention layer i: latent KV [num_pages, page_size, R + P] BF16 and
//     (DSA) indexer keys [num_pages, page_size, Di] BF16, pages shared by all
//     layers through the slots' block tables (with DCP, 1/D of the context).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "config/model_config.h"
#include "core/bf16.h"
#include "core/cuda.h"
#include "ops/kda.h"

struct CUstream_st;

namespace k3 {

class GpuCaches {
 public:
  GpuCaches(const ModelConfig& c, int kda_heads, int max_slots, int max_q, int64_t num_pages, int page_size);

  // Zeroes a slot's committed KDA states (a new request) and makes buffer 0 its current state.
  void reset_slot(int slot, CUstream_st* s);
  // The slot's states in the state pools: the current one (a step reads it) and the other (a step writes it).
  int32_t read_state(int slot) const { return 2 * slot + cur_[slot]; }
  int32_t write_state(int slot) const { return 2 * slot + 1 - cur_[slot]; }
  // Commits the last step (q tokens per request) of `slots`, accepted[b] of them each: d_slots, d_accepted,
  // d_read, d_write are the same [B] on the device (d_read / d_write from read_state / write_state). Flips
  // the current state of every slot with accepted[b] > 0.
  void commit(std::span<const int> slots, std::span<const int> accepted, int q, const int32_t* d_slots,
              const int32_t* d_accepted, const int32_t* d_read, const int32_t* d_write, CUstream_st* s);

  float* conv(int layer, int j) { return conv_[3 * kda_index_[layer] + j].get<float>(); }
  float* conv_x(int layer, int j) { return conv_x_[3 * kda_index_[layer] + j].get<float>(); }
  float* state(int layer) { return state_[kda_index_[layer]].get<float>(); }
  ops::cuda::KdaKept kept(int layer);
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
  int max_slots_, max_q_, heads_, head_dim_, conv_kernel_;
  int64_t conv_floats_, state_floats_;  // per slot: C (K-1), Hk d d
  std::vector<DeviceBuffer> conv_, conv_x_, state_, kept_;  // per KDA layer: 3 convs, 3 conv inputs, 2 S per slot, kept
  std::vector<int> cur_;                                    // per slot: its current state buffer (0 / 1)
  std::vector<DeviceBuffer> kv_, index_;                              // per full-attention layer
  std::vector<int> kda_index_, full_index_;                          // layer -> index among its kind, or -1
  size_t bytes_ = 0;
};

}  // namespace k3
