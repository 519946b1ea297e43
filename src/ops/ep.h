// The expert-parallel exchange with a fixed capacity (the GPU MoE over the
// world group; fixed shapes, no count read back to the host, so it fits a
// CUDA graph). W ranks own E / W experts each (rank p: [p E/W, (p+1) E/W)).
//
// Whole rows (Gs = 1): a rank routes its shard's `rows` rows, pairs
// i = r k + j (row r, choice j), and sends each pair's latent row z[r] to the
// owner of its expert.
// Sliced rows (Gs = G > 1, the hybrid step with --shared-experts tp): the G
// ranks of a TP group (world ranks g G .. g G + G - 1) all route the same m
// rows (replicated router, identical rows: the same top-k everywhere) and each
// computes only its Ls = L / G columns of z (its rows of the latent down
// projection). Every member sends its slice of every pair of the group; the
// owner concatenates the G slices of a pair into its latent row. Row r of the
// m belongs to member r / cs (the step's sp_shard), which alone gets the
// pair's expert output back and combines it.
//
//   pos(i)     = the number of pairs i' < i of the routed rows with the same dest
//                (the (row, choice) order of the CPU moe_ffn's dispatch);
//   pos_own(i) = the same count among the pairs of i's owner only; pos_own < cap.
//   ep_pack:    send_slot[i] = dest Gs cap + pos(i)  (-1 for an id outside [0, W experts_per_rank))
//               send[send_slot[i]] = z[r]  ([W, Gs cap, Ls])
//               slot[i - t cs k] = dest cap + pos_own(i) for this rank's own pairs (owner t)
//               meta [W, M]: M = cap (Gs = 1: the ids) or 2 Gs cap (Gs > 1: the ids,
//               then code = owner cap + pos_own); unused ids and codes are -1
//               (moe_experts skips them: -1 is outside every rank's range);
//               unused send rows are left as they are.
//   exchange:   all_to_all of meta (M per peer) and send (Gs cap Ls = cap L per peer).
//   ep_assemble (Gs > 1): recv [W, Gs cap, Ls] -> z [W cap, L], row (g Gs cap + j)
//               = concat over t of recv[g Gs + t, j]; ids / codes [W cap] from
//               member 0's meta; rows of unused slots (id -1) are left as they are.
//               (Gs = 1: recv is already z and meta the ids.)
//   owner:      runs each assembled row's expert (k = 1, weight 1): out [W cap, L].
//   ep_return (Gs > 1): back[(g Gs + code / cap) cap + code % cap] = out[g Gs cap + j]
//               for every valid slot: [W, cap, L], each row addressed to its
//               owner. (Gs = 1: out is already in that order.)
//   exchange:   all_to_all back (cap L per peer): a rank gets, at dest cap + pos_own,
//               the expert output of its own pair sent there.
//   ep_combine: y[r] = bf16(sum over j in 0..k-1, in order, of w[r, j] back[slot[r k + j]])
//               over the own rows, accumulated in FP32 from +0 (the CPU moe_ffn's
//               combine; slot -1 pairs skipped).
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"
#include "ops/rmsnorm.h"

namespace k3::ops {

// The rows one rank routes into the exchange and which of them are its own.
struct EpShard {
  int64_t rows = 0;          // routed rows (Gs = 1: the rank's shard; Gs > 1: the group's m rows)
  int k = 1;                 // choices per row
  int64_t cs = 0;            // rows per member: row r belongs to member r / cs (Gs = 1: cs >= rows)
  int t = 0;                 // this rank's member index in its group (0 when Gs = 1)
  int Gs = 1;                // members sending slices of one pair
  int64_t Ls = 0;            // columns per sent row: L / Gs
  int experts_per_rank = 1;  // E / W
  int W = 1;                 // world ranks
  int64_t cap = 0;           // slots per (owner, dest): >= cs k
  int64_t own0() const;      // first own row: min(rows, t cs)
  int64_t own() const;       // own rows
  int64_t meta() const { return Gs == 1 ? cap : 2 * Gs * cap; }  // M
};

// Errors on a shard whose pairs cannot fit (cs k > cap, rows > Gs cs, t outside the group, ...).
void check(const EpShard& s);

// idx [rows, k] global expert ids; z [rows, Ls] -> slot [own k], send_slot [rows k], meta [W, M],
// send [W, Gs cap, Ls].
void ep_pack(const int32_t* idx, const float* z, const EpShard& s, int32_t* slot, int32_t* send_slot, int32_t* meta,
             float* send);
// recv [W, Gs cap, Ls], recv_meta [W, M] -> z [W cap, L], ids [W cap], codes [W cap] (Gs > 1).
void ep_assemble(const float* recv, const int32_t* recv_meta, const EpShard& s, float* z, int32_t* ids,
                 int32_t* codes);
// out [W cap, L], ids, codes [W cap] -> back [W, cap, L] (Gs > 1; rows of unused slots left as they are).
void ep_return(const float* out, const int32_t* ids, const int32_t* codes, const EpShard& s, float* back);
// back [W, cap, L]; slot [rows k]; w [rows, k] FP32 -> y [rows, L] (BF16 values).
void ep_combine(const float* back, const int32_t* slot, const float* w, int64_t rows, int k, int64_t L, float* y);

}  // namespace k3::ops

namespace k3::ops::cuda {

// As the CPU ops, device pointers, BF16 rows, int32 ids / slots / codes. They return
// cudaErrorInvalidValue on a shard the CPU check rejects.
int ep_pack(const int32_t* idx, const bf16* z, const EpShard& s, int32_t* slot, int32_t* send_slot, int32_t* meta,
            bf16* send, CUstream_st* stream);
int ep_assemble(const bf16* recv, const int32_t* recv_meta, const EpShard& s, bf16* z, int32_t* ids, int32_t* codes,
                CUstream_st* stream);
int ep_return(const bf16* out, const int32_t* ids, const int32_t* codes, const EpShard& s, bf16* back,
              CUstream_st* stream);
// ep_combine with norm.w != nullptr: y = RMSNorm(that y; norm.w [L], norm.eps) (the latent norm), the bits of
// a separate rmsnorm on it.
int ep_combine(const bf16* back, const int32_t* slot, const float* w, int64_t rows, int k, int64_t L, bf16* y,
               CUstream_st* stream, const RowNorm& norm = {});

}  // namespace k3::ops::cuda
