// Shared by the two translation units of moe_experts (moe_experts.cu: plan, combine and the entry point;
// moe_experts_ws.cu: the warp-specialized expert GEMMs; C++17): the routing plan in scratch and the GEMMs'
// launcher.
#pragma once

#include <cstdint>

#include "ops/moe.h"

namespace k3::ops::cuda::detail {

// The routing plan in scratch (int32): a header of n_active, n_passes and two work counters, then [pairs]
// each of slot_expert, slot_begin, slot_count, slot_pass_begin (the slots of the experts in use, ascending
// expert; the exclusive prefix of their passes of `cols` token columns, n_passes the total), slot_done (the
// up-projection items finished per slot, for the fused launch) and pair_list (pair ids grouped by slot).
// The plan kernel zeroes the counters and slot_done, so every launch starts from a clean plan.
struct MoePlan {
  int* n_active;
  int* n_passes;
  int* next_a;  // the work counter of the fused launch, or of the up launch
  int* next_b;  // the work counter of the down launch (two launches)
  int* slot_expert;
  int* slot_begin;
  int* slot_count;
  int* slot_pass_begin;
  int* slot_done;
  int* pair_list;
};

constexpr int kMoePlanHeader = 4;
constexpr int kMoePlanArrays = 6;
__host__ __device__ inline MoePlan moe_plan_at(void* scratch, int64_t pairs) {
  int* m = static_cast<int*>(scratch);
  int* a = m + kMoePlanHeader;
  return MoePlan{m,         m + 1,         m + 2,         m + 3,         a,
                 a + pairs, a + 2 * pairs, a + 3 * pairs, a + 4 * pairs, a + 5 * pairs};
}

// The token tile (pairs per work item, a multiple of 8 up to 64) for `pairs` pairs over at most `max_slots`
// experts in use: the mean per expert with headroom; an expert with more pairs takes more tiles.
int moe_token_tile(int64_t pairs, int64_t max_slots);

// The expert GEMMs of moe_experts on the plan (built with cols = T): h[pair] = situ(W1 z, W3 z) for every
// planned pair, then o[pair] = W2 h[pair]. z [rows, L] (row pair / k), h [pairs, I], o [pairs, L] BF16.
int moe_expert_gemms(const MoePlan& plan, const Mxfp4ExpertTable& ex, const bf16* z, bf16* h, bf16* o, int k,
                     int64_t L, int64_t I, int T, SituParams sp, int sms, CUstream_st* stream);

}  // namespace k3::ops::cuda::detail
