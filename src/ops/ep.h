// The expert-parallel exchange with a fixed capacity (the GPU MoE over the
// world group; fixed shapes, no count read back to the host, so it fits a
// CUDA graph). W ranks own E / W experts each (rank p: [p E/W, (p+1) E/W)).
// A shard of `rows` rows routes pairs i = r k + j (row r, choice j):
//
//   ep_pack:    pair i goes to dest(i) = idx[i] / experts_per_rank, slot
//               pos(i) = the number of pairs i' < i with the same dest (the
//               (row, choice) order of the CPU moe_ffn's dispatch):
//                 slot[i] = dest cap + pos   (-1 for an id outside [0, W experts_per_rank))
//                 send_ids[dest, pos] = idx[i];  send[dest, pos] = z[r]
//               unused slots get send_ids = -1 (moe_experts skips them: their
//               id is outside every rank's range); their rows are left as they are.
//               rows k <= cap, so no pair is ever dropped.
//   exchange:   all_to_all of the [W, cap] ids and [W, cap, L] rows (equal
//               counts), the owner runs each received row's expert (k = 1,
//               weight 1: the expert output exactly), all_to_all back:
//               back[dest, pos] = the expert output of the pair sent there.
//   ep_combine: y[r] = bf16(sum over j in 0..k-1, in order, of w[r, j] back[slot[r k + j]])
//               accumulated in FP32 from +0 (the CPU moe_ffn's combine; slot -1 pairs skipped).
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

// idx [rows, k] global expert ids; z [rows, L]; slot [rows k]; send_ids [W, cap]; send [W, cap, L].
void ep_pack(const int32_t* idx, const float* z, int64_t rows, int k, int64_t L, int experts_per_rank, int W,
             int64_t cap, int32_t* slot, int32_t* send_ids, float* send);
// back [W, cap, L]; slot [rows k]; w [rows, k] FP32 -> y [rows, L] (BF16 values).
void ep_combine(const float* back, const int32_t* slot, const float* w, int64_t rows, int k, int64_t L, float* y);

}  // namespace k3::ops

namespace k3::ops::cuda {

// As the CPU ep_pack, device pointers: idx int32 [rows, k], z BF16 [rows, L] -> slot int32 [rows k],
// send_ids int32 [W, cap], send BF16 [W, cap, L]. rows k <= cap.
int ep_pack(const int32_t* idx, const bf16* z, int64_t rows, int k, int64_t L, int experts_per_rank, int W,
            int64_t cap, int32_t* slot, int32_t* send_ids, bf16* send, CUstream_st* stream);
// As the CPU ep_combine: back BF16 [W, cap, L], slot int32 [rows k], w F32 [rows, k] -> y BF16 [rows, L].
int ep_combine(const bf16* back, const int32_t* slot, const float* w, int64_t rows, int k, int64_t L, bf16* y,
               CUstream_st* stream);

}  // namespace k3::ops::cuda
