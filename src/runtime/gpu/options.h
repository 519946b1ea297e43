// GpuRankOptions: the capacities and the collectives of one GpuRank, fixed at
// construction (everything a step needs is allocated from them up front).
#pragma once

#include <cstdint>

#include "comm/comm.h"
#include "config/model_config.h"
#include "runtime/gpu/collectives.h"
#include "runtime/steps.h"

namespace k3 {

bool moe_shared_group_default();  // K3_MOE_SHARED_GROUP (0 or 1, default 1), read once (gpu/moe.cpp)

struct GpuRankOptions {
  int max_slots = 8;
  int max_batch = 8;            // requests per step
  int max_q = 16;               // tokens per request per step
  int64_t max_context = 512;
  int page_size = 64;
  int64_t num_pages = 0;        // KV pages (0: enough for every slot at max_context)
  ShardSpec shard;              // the split of the weights
  bool loopback = false;        // collectives move bytes only (tp_size / world_size > 1)
  RankGroups* groups = nullptr; // real collectives: this rank's device comms (outlive the GpuRank)
  StepOptions steps;            // the step a decoder takes (choose_step)
  // The hybrid step's TP-sharded shared experts in the router's projection group where the latent down is
  // sliced, at 1-2 rows and the tensor-core group's rows (gpu/moe.cpp); default
  // K3_MOE_SHARED_GROUP (1 unless set to 0, docs/PERF.md).
  bool moe_shared_group = moe_shared_group_default();
};

// The collectives' mode of these options (runtime/gpu/collectives.h): one rank, loopback, or real.
inline GpuCollectives::Mode collective_mode(const GpuRankOptions& o) {
  if (o.shard.tp_size == 1 && o.shard.world_size == 1) return GpuCollectives::Mode::Single;
  return o.loopback ? GpuCollectives::Mode::Loopback : GpuCollectives::Mode::Real;
}

}  // namespace k3
