// The MLA attend launchers (see mla.h for the math): mla_attend_paged (dense decode: every cached entry
// visible to the token) and mla_attend_indexed (DSA: the selected entries), their scratch sizes, the
// choice between the two kernels and the context split plan of the 48-row kernel.
//
//   rows: (token, head) pairs; a group is the rows that share their entries (dense: the q_len tokens of
//   one request, sparse: the heads of one token). Flash decoding: a context split is a CTA that streams
//   part of the entries and writes a partial (o / l, m + log l); lse_merge combines the splits.
//   Kernels: mla_attend_wg.cu (Hopper: wgmma, TMA; up to 48 rows per CTA), mla_attend_mt.cu (mma.sync, up
//   to 48 rows per CTA), mla_attend_16.cu (mma.sync, 16 rows per CTA).
//   The choice: dense decode at the K3 latent shape (R 512, P 64) with a page size TMA can tile
//   (wg_supported) takes the Hopper kernel, whatever the batch; everything else (DSA's gathered entries,
//   other shapes such as the tiny preset's, other page sizes) the mma.sync kernels: many groups
//   (>= kTile16MinGroups) of at most 16 rows the 16-row kernel (several CTAs per SM), the rest the
//   48-row kernel.
//   Splits of the 48-row and Hopper kernels (plan_splits): one CTA per SM fits (~170-227 KB of shared
//   memory), so the split count minimises waves x tiles per split plus the partials' traffic; each CTA
//   cuts its own rows' actual length (not the max_len bound) into that many chunks. The 16-row kernel
//   has its own split plan (namespace tile16).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "ops/cuda_device.cuh"
#include "ops/mla.h"
#include "ops/mla_attend.cuh"

namespace k3::ops::cuda {
namespace mla_detail {
namespace {

using detail::aligned16;

constexpr int kTile16MinGroups = 8;  // groups of <= 16 rows from this many on take the 16-row kernel (below)

AttendShape attend_shape(int rows) {
  const int mctas = std::max(1, (rows + kMaxRows - 1) / kMaxRows);
  const int per = std::max(1, (rows + mctas - 1) / mctas);
  return {mctas, per, (per + 15) / 16};
}

// Context splits per CTA row block. A split is a CTA that streams ~1/splits of the context and
// writes a partial (o / l, lse) merged by lse_merge. One CTA per SM (the shared memory of a tile
// pair), so the cost of s splits in tile times is waves x (tiles per split + 1, the start-up) plus
// the partials' traffic (rows x R floats written and read back, as a fraction of a tile), spread
// over the SMs. A plan with splits launches at most max_split_ctas() CTAs.
int plan_splits(int64_t ctas, int64_t max_len, int rows_per_cta, int R, int E) {
  const int64_t tiles = (max_len + kBN - 1) / kBN;
  if (tiles <= 1 || ctas <= 0) return 1;
  const int64_t sms = detail::device_sm_count();
  const int64_t smax = std::min<int64_t>(tiles, std::max<int64_t>(1, max_split_ctas() / ctas));
  const double split_tiles =
      2.0 * rows_per_cta * (static_cast<double>(R) + 1) * 4 / (static_cast<double>(kBN) * E * 2);
  int64_t best = 1;
  double best_cost = 0;
  for (int64_t s = 1; s <= smax; ++s) {
    const int64_t per = (tiles + s - 1) / s;
    const int64_t waves = (ctas * s + sms - 1) / sms;
    const double cost = static_cast<double>(waves * (per + 1)) +
                        (s > 1 ? static_cast<double>(ctas * s) * split_tiles / sms : 0.0);
    if (s == 1 || cost < best_cost - 1e-9) {
      best = s;
      best_cost = cost;
    }
  }
  return static_cast<int>(best);
}

}  // namespace

size_t partial_bytes(int splits, int64_t T, int H, int R) {
  if (splits <= 1) return 0;
  const size_t n = static_cast<size_t>(splits) * static_cast<size_t>(T) * static_cast<size_t>(H);
  return (n * static_cast<size_t>(R) + n) * sizeof(float);
}

namespace {

// Scratch for any call with at most `rows` (token, head) rows, groups of at most `group_rows` rows and
// lengths <= max_len: splits x rows <= rows x min(tiles, max_split_ctas()), and splits x CTAs <=
// max_split_ctas() with at most min(group_rows, kMaxRows) rows per CTA. The engine sizes its scratch once
// for max_batch x max_q and then runs smaller steps, whose plans split more: this bound covers them.
size_t partial_bound(int64_t rows, int group_rows, int64_t max_len, int R) {
  const int64_t tiles = (max_len + kBN - 1) / kBN;
  if (rows <= 0 || group_rows <= 0 || R <= 0 || tiles <= 1) return 0;
  const int64_t max_ctas = max_split_ctas();
  const int64_t n = std::min(rows * std::min<int64_t>(tiles, max_ctas), max_ctas * std::min(group_rows, kMaxRows));
  return (static_cast<size_t>(n) * static_cast<size_t>(R) + static_cast<size_t>(n)) * sizeof(float);
}

template <bool INDEXED>
int launch_attend(AttendParams p, int64_t groups, int rows_per_group, void* scratch, size_t scratch_bytes, float* o_lat,
                  float* lse, cudaStream_t stream) {
  const int E = p.R + p.P;
  if (p.H <= 0 || p.R <= 0 || p.R > kMaxR || p.P < 0 || E % 8 != 0 || p.page_size <= 0 || p.max_pages < 0 ||
      p.max_len < 0 || p.T < 0 || groups > 65535 || !aligned16(p.q_lat) || !aligned16(p.pool))
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  const bool wg = !INDEXED && wg_supported(p);
  if (!wg && rows_per_group <= 16 && groups >= kTile16MinGroups) {
    return tile16::launch<INDEXED>(p, groups, rows_per_group, scratch, scratch_bytes, o_lat, lse, stream);
  }
  const AttendShape sh = attend_shape(rows_per_group);
  const int splits = plan_splits(groups * sh.mctas, p.max_len, sh.rows_per_cta, p.R, E);
  const size_t need = partial_bytes(splits, p.T, p.H, p.R);
  if (need > 0 && (scratch == nullptr || scratch_bytes < need)) return cudaErrorInvalidValue;
  float* o_parts = o_lat;
  float* lse_parts = lse;
  if (splits > 1) {
    o_parts = static_cast<float*>(scratch);
    lse_parts = o_parts + static_cast<size_t>(splits) * static_cast<size_t>(p.T) * p.H * p.R;
  }
  p.o_out = o_parts;
  p.lse_out = lse_parts;
  p.rows_per_cta = sh.rows_per_cta;
  const cudaError_t err =
      wg ? launch_attend_wg(p, sh, splits, groups, stream) : launch_attend_mt<INDEXED>(p, sh, splits, groups, stream);
  if (err != cudaSuccess || splits <= 1) return err;
  return lse_merge(o_parts, lse_parts, splits, p.T, p.H, p.R, o_lat, lse, stream);
}

}  // namespace
}  // namespace mla_detail

using mla_detail::AttendParams;
using mla_detail::bf16raw;
using mla_detail::launch_attend;
using mla_detail::partial_bound;

size_t mla_attend_paged_scratch_bytes(int B, int q_len, int H, int R, int max_ctx) {
  if (B <= 0 || q_len <= 0 || H <= 0 || R <= 0 || max_ctx <= 0) return 0;
  return partial_bound(static_cast<int64_t>(B) * q_len * H, q_len * H, max_ctx, R);
}

int mla_attend_paged(const bf16* q_lat, const bf16* kv_pool, const int32_t* block_tables, int max_pages, int page_size,
                     const int32_t* ctx_len, int B, int q_len, int max_ctx, int H, int R, int P, float scale,
                     float* o_lat, float* lse, void* scratch, size_t scratch_bytes, CUstream_st* stream) {
  if (B < 0 || q_len < 0) return cudaErrorInvalidValue;
  AttendParams p{};
  p.q_lat = reinterpret_cast<const bf16raw*>(q_lat);
  p.pool = reinterpret_cast<const bf16raw*>(kv_pool);
  p.tables = block_tables;
  p.ctx_len = ctx_len;
  p.T = static_cast<int64_t>(B) * q_len;
  p.max_pages = max_pages;
  p.page_size = page_size;
  p.q_len = q_len;
  p.H = H;
  p.R = R;
  p.P = P;
  p.max_len = max_ctx;
  p.scale = scale;
  return launch_attend<false>(p, B, q_len * H, scratch, scratch_bytes, o_lat, lse, stream);
}

size_t mla_attend_indexed_scratch_bytes(int64_t T, int H, int R, int max_sel) {
  if (T <= 0 || H <= 0 || R <= 0 || max_sel <= 0) return 0;
  return partial_bound(T * H, H, max_sel, R);
}

int mla_attend_indexed(const bf16* q_lat, const bf16* kv_pool, const int32_t* block_tables, int max_pages,
                       int page_size, const int32_t* sel, const int32_t* sel_count, int max_sel, int B, int q_len,
                       int H, int R, int P, float scale, float* o_lat, float* lse, void* scratch, size_t scratch_bytes,
                       CUstream_st* stream) {
  if (B < 0 || q_len <= 0) return B == 0 ? cudaSuccess : cudaErrorInvalidValue;
  AttendParams p{};
  p.q_lat = reinterpret_cast<const bf16raw*>(q_lat);
  p.pool = reinterpret_cast<const bf16raw*>(kv_pool);
  p.tables = block_tables;
  p.sel = sel;
  p.sel_count = sel_count;
  p.T = static_cast<int64_t>(B) * q_len;
  p.max_pages = max_pages;
  p.page_size = page_size;
  p.max_sel = max_sel;
  p.q_len = q_len;
  p.H = H;
  p.R = R;
  p.P = P;
  p.max_len = max_sel;
  p.scale = scale;
  return launch_attend<true>(p, p.T, H, scratch, scratch_bytes, o_lat, lse, stream);
}

}  // namespace k3::ops::cuda
