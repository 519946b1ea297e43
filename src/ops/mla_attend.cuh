// Internal header of the MLA attend translation units (see mla.h for the math): mla_attend.cu (the
// launchers mla_attend_paged / mla_attend_indexed, the choice of kernel and the context split plan),
// mla_attend_wg.cu (the Hopper kernel: wgmma, TMA; dense decode at the K3 latent shape),
// mla_attend_mt.cu (the mma.sync kernel of up to 48 query rows per CTA) and mla_attend_16.cu (the 16-row
// kernel).
// Here: the tile shape of the 48-row kernel that the plan depends on, the parameters both kernels take,
// the byte size of the split partials, and the launch functions each kernel's file defines.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/cuda_device.cuh"

namespace k3::ops::cuda::mla_detail {

using bf16raw = __nv_bfloat16;

constexpr int kBN = 64;                        // cache entries per tile
constexpr int kMaxMT = 3;                      // M tiles (16 query rows each) per CTA
constexpr int kMaxRows = 16 * kMaxMT;          // query rows per CTA
constexpr int kColWarps = 4;                   // warps per M tile, each a quarter of R in P.V
constexpr int kThreadsPerMT = 32 * kColWarps;  // blockDim.x = kThreadsPerMT * MT
constexpr int kQKWarps = kColWarps;            // the same warps in S: entries 16 w .. 16 w + 15 each
constexpr int kMaxPairs = 8;                   // 16-column pairs of R per warp: R <= 16 * 8 * 4 = 512
constexpr int kMaxR = 16 * kMaxPairs * kColWarps;
constexpr int kPS = kBN + 8;  // row stride (elements) of the P tiles: 144 B, conflict-free ldmatrix

static_assert(kBN == 16 * kQKWarps, "QK mapping: 16 entries per QK warp");
static_assert(2 * kBN <= kThreadsPerMT, "prologue: one thread per row index of tiles 0 and 1");

// Row stride (elements) of the Q and entry tiles: K padded to 16 (zeros), +8 elements so that
// the stride is an odd multiple of 16 bytes and the 8 rows of an ldmatrix hit 8 different banks.
__host__ __device__ inline int attend_ek16(int E) { return (E + 15) & ~15; }
__host__ __device__ inline int attend_es(int E) { return attend_ek16(E) + 8; }

struct AttendParams {
  const bf16raw* q_lat;      // [T, H, E]
  const bf16raw* pool;       // [num_pages, page_size, E]
  const int32_t* tables;     // [B, max_pages]
  const int32_t* ctx_len;    // dense: [T]
  const int32_t* sel;        // sparse: [T, max_sel]
  const int32_t* sel_count;  // sparse: [T]
  float* o_out;              // [splits, T, H, R]
  float* lse_out;            // [splits, T, H]
  int64_t T;
  int max_pages, page_size, max_sel, q_len, H, R, P;
  int max_len;       // upper bound of every row's length (max_ctx or max_sel)
  int rows_per_cta;  // query rows per CTA (<= kMaxRows); blockDim.x = kThreadsPerMT * ceil(rows_per_cta / 16)
  int chunk;         // tile16 kernel only: entries per split (a multiple of its 32-entry tile)
  float scale;
};

// CTAs in M for one group (request or token) of `rows` query rows: as few as fit kMaxRows, balanced.
struct AttendShape {
  int mctas;         // CTAs per group (grid.x)
  int rows_per_cta;  // rows of each (the last may have fewer)
  int mt;            // M tiles per CTA: blockDim.x = kThreadsPerMT * mt
};

// Two BF16 -> a 32-bit word (lo in the low half, the lower address).
__device__ __forceinline__ uint32_t pack_bf16(bf16raw lo, bf16raw hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) | (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

// A plan with splits never launches more CTAs than this (about two waves; it bounds the scratch, see
// partial_bound): the split plans' only device assumption, the SM count of the current device.
inline int max_split_ctas() { return 2 * detail::device_sm_count(); }

// Bytes of the partials (o [splits, T, H, R], lse [splits, T, H], FP32) of a split launch (0: no split).
size_t partial_bytes(int splits, int64_t T, int H, int R);

// The 48-row kernel (mla_attend_mt.cu) on grid (sh.mctas, splits, groups), p.o_out / p.lse_out set by the
// caller; launch only (the caller merges the splits).
template <bool INDEXED>
cudaError_t launch_attend_mt(const AttendParams& p, const AttendShape& sh, int splits, int64_t groups,
                             cudaStream_t stream);

// The Hopper kernel (mla_attend_wg.cu): dense decode only, R = kWgR, P = kWgP, a page size that is a
// multiple of 64 or a divisor of 64 of at least 8 (TMA boxes of whole page runs), on a compute capability
// 9.x device. Same grid, shape (AttendShape, up to 48 rows per CTA), splits and partial outputs as
// launch_attend_mt.
constexpr int kWgR = 512, kWgP = 64;
bool wg_supported(const AttendParams& p);
cudaError_t launch_attend_wg(const AttendParams& p, const AttendShape& sh, int splits, int64_t groups,
                             cudaStream_t stream);

namespace tile16 {
// The 16-row kernel (mla_attend_16.cu) with its own split plan and the merge of its splits; the caller
// (launch_attend, mla_attend.cu) has checked p.
template <bool INDEXED>
int launch(AttendParams p, int64_t groups, int rows_per_group, void* scratch, size_t scratch_bytes, float* o_lat,
           float* lse, cudaStream_t stream);
}  // namespace tile16

}  // namespace k3::ops::cuda::mla_detail
