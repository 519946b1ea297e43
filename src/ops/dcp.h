// DSA's global top-k over DCP shards (kimi-k3.md section 2 with --dcp D; the
// CPU mla_attention's dsa_select, in three small steps on the device). DCP
// rank r of D holds positions p = j D + r at local index j. T rows, top-k k.
//
//   dcp_topk_candidates: this rank's local top-k (local indices sel [T, k],
//       counts n [T]) and the local scores [T, ld] -> candidates
//         score[t, j] = scores[t, sel[t, j]], pos[t, j] = sel[t, j] D + r   (j < n[t])
//         score = -inf, pos = -1                                         (j >= n[t])
//   (the candidates of the D ranks are all-gathered: [D, T, k])
//   dcp_scatter_candidates: every rank's candidates into a dense row per token
//         dense[t, p] = score of candidate position p, -inf where no rank proposed p
//       then topk_indices(dense, ld, ctx_len = t's global context) picks the same
//       global top-k everywhere (ties to the lower position: the CPU's order).
//       At least min(k, ctx) positions are candidates, so no -inf column is picked.
//   dcp_local_selection: the global selection sel [T, k] (positions, counts n)
//       -> the positions this rank holds, as local indices, in the same order:
//         out[t, :] = [p / D for p in sel[t, :n[t]] if p mod D == r], count[t]; rest -1.
#pragma once

#include <cstdint>

#include "ops/cuda_context.h"

namespace k3::ops {

// scores [T, ld]; sel [T, k]; n [T] -> cand_score [T, k], cand_pos [T, k].
void dcp_topk_candidates(const float* scores, int64_t ld, const int32_t* sel, const int32_t* n, int64_t T, int k,
                         int D, int r, float* cand_score, int32_t* cand_pos);
// cand_score, cand_pos [D, T, k] -> dense [T, ld] (every column written).
void dcp_scatter_candidates(const float* cand_score, const int32_t* cand_pos, int D, int64_t T, int k, int64_t ld,
                            float* dense);
// sel [T, k] global positions, n [T] -> out [T, k] local indices (-1 padded), count [T].
void dcp_local_selection(const int32_t* sel, const int32_t* n, int64_t T, int k, int D, int r, int32_t* out,
                         int32_t* count);

}  // namespace k3::ops

namespace k3::ops::cuda {

// As the CPU functions above, device pointers (int32 / F32 as there). k >= 1, D >= 1, 0 <= r < D.
int dcp_topk_candidates(const float* scores, int64_t ld, const int32_t* sel, const int32_t* n, int64_t T, int k, int D,
                        int r, float* cand_score, int32_t* cand_pos, CUstream_st* stream);
int dcp_scatter_candidates(const float* cand_score, const int32_t* cand_pos, int D, int64_t T, int k, int64_t ld,
                           float* dense, CUstream_st* stream);
int dcp_local_selection(const int32_t* sel, const int32_t* n, int64_t T, int k, int D, int r, int32_t* out,
                        int32_t* count, CUstream_st* stream);

}  // namespace k3::ops::cuda
