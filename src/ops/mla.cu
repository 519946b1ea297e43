// CUDA kernels of the absorbed Gated MLA decode (see mla.h for the math).
//
//   mla_absorb_q: one strided-batched cuBLASLt product over the heads (ops/linear.h), q_pe copied
//     beside it; without a cuBLASLt algorithm, per (head, 128 columns of R, 16 tokens) CTA; q_nope of
//     the tokens in shared memory, each thread one column, W_uk read once per CTA (coalesced rows),
//     FP32 sums over dn in the CPU's order, rounded to BF16; q_pe copied through.
//   mla_attend_paged / mla_attend_indexed: flash decoding on tensor cores (mma.sync m16n8k16,
//     BF16 inputs, FP32 accumulation, fragments through ldmatrix). Dense rows are the (token,
//     head) pairs of one request, whose q_len tokens share every cache entry; sparse rows are the
//     heads of one token. A CTA owns up to 48 rows of one group (MT = 1..3 M tiles of 16, blockDim
//     128 MT; more rows take more CTAs: 64 rows would not fit 227 KB of shared memory) and one
//     context split, so each cache entry is read once per request and split. Tiles of 64
//     (R+P)-wide entries stream through shared memory (cp.async, double buffered, a warp copies 512
//     contiguous bytes); the pool row of each entry (block table, DSA selection) is looked up two
//     tiles ahead, between this tile's steps, so the copies never wait on it. Per tile, 4 barriers:
//       S = scale Q E^T: the 4 warps of an M tile take 16 entries each (4 accumulator chains, the
//         odd k steps split off), mask (entry j < the row's length), row max of their 16 entries
//         to shared memory (warps 0..3 computing every M tile left 2/3 of the warps idle);
//       online softmax in FP32 in the same warps: tile max from the 4 partial maxima, p =
//         exp(s - m) split into BF16 hi + lo (~16 mantissa bits: the FP32 weights of the CPU
//         within ~1e-5) stored as the A operand, partial row sums; thread r updates l of row r;
//       O = corr O + P E[:, :R]: warp (M tile, quarter of R) with two MMAs (hi, lo) per B
//         fragment, B from ldmatrix.trans of the row-major entry tile (O: 64 FP32 per thread).
//     Row strides of the Q, E and P tiles are odd multiples of 16 bytes: conflict-free ldmatrix.
//     Each split writes (o / l, m + log l), and lse_merge combines the splits exactly as it
//     merges DCP partials. Splits (plan_splits): one CTA per SM fits (~170-220 KB of shared
//     memory), so the split count minimises waves x tiles per split plus the partials' traffic;
//     each CTA cuts its own rows' actual length (not the max_len bound) into that many chunks.
//     Many groups (>= kTile16MinGroups) of at most 16 rows take mla_attend16_kernel instead (the
//     earlier 16-row, 32-entry-tile kernel, namespace tile16): with one ~170 KB CTA of 4 warps per SM
//     the kernel above streams slowly, while the 16-row kernel fits several CTAs per SM.
//   lse_merge: one CTA per (token, head, 128 columns), four thread groups over quarters of the parts
//     when the CTAs are few, else one; weights exp(lse_i - max) / sum as the CPU (the sum in its
//     order), the groups' partials added in order.
//   mla_unabsorb: one strided-batched cuBLASLt product over the heads; without a cuBLASLt algorithm,
//     one warp per output row of W_uv, 8 tokens per CTA from shared memory.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/cuda_cp_async.cuh"
#include "ops/cuda_device.cuh"
#include "ops/cuda_mma.cuh"
#include "ops/linear.h"
#include "ops/mla.h"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;

using detail::allow_optin_smem;

using bf16raw = __nv_bfloat16;

using detail::warp_sum;

// ---------------------------------------------------------------- absorb
constexpr int kAbsThreads = 128;  // one column of R per thread
constexpr int kAbsTokens = 16;    // tokens per CTA

__global__ void __launch_bounds__(kAbsThreads)
    mla_absorb_q_kernel(const bf16raw* __restrict__ q, const bf16raw* __restrict__ w, bf16raw* __restrict__ q_lat,
                        int64_t T, int H, int dn, int P, int dv, int R) {
  extern __shared__ __align__(16) float qs[];  // [kAbsTokens][dn4] q_nope as FP32, zero padded
  const int dn4 = (dn + 3) & ~3;
  const int h = blockIdx.y;
  const int64_t t0 = static_cast<int64_t>(blockIdx.z) * kAbsTokens;
  const int nt = static_cast<int>(min(static_cast<int64_t>(kAbsTokens), T - t0));
  const int64_t q_stride = dn + P, lat_stride = static_cast<int64_t>(R) + P;
  for (int i = threadIdx.x; i < kAbsTokens * dn4; i += kAbsThreads) {
    const int tt = i / dn4, j = i % dn4;
    qs[i] = (tt < nt && j < dn) ? __bfloat162float(q[((t0 + tt) * H + h) * q_stride + j]) : 0.f;
  }
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < nt * P; i += kAbsThreads) {
      const int tt = i / P, pp = i % P;
      q_lat[((t0 + tt) * H + h) * lat_stride + R + pp] = q[((t0 + tt) * H + h) * q_stride + dn + pp];
    }
  }
  __syncthreads();
  const int col = blockIdx.x * kAbsThreads + threadIdx.x;
  if (col >= R) return;
  const bf16raw* wc = w + static_cast<int64_t>(h) * (dn + dv) * R + col;  // W_uk_h[:, col]
  float acc[kAbsTokens];
#pragma unroll
  for (int tt = 0; tt < kAbsTokens; ++tt) acc[tt] = 0.f;
  for (int i = 0; i < dn4; i += 4) {
    float wv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) wv[u] = i + u < dn ? __bfloat162float(wc[static_cast<int64_t>(i + u) * R]) : 0.f;
#pragma unroll
    for (int tt = 0; tt < kAbsTokens; ++tt) {
      const float4 qv = *reinterpret_cast<const float4*>(&qs[tt * dn4 + i]);
      acc[tt] += qv.x * wv[0];
      acc[tt] += qv.y * wv[1];
      acc[tt] += qv.z * wv[2];
      acc[tt] += qv.w * wv[3];
    }
  }
#pragma unroll
  for (int tt = 0; tt < kAbsTokens; ++tt)
    if (tt < nt) q_lat[((t0 + tt) * H + h) * lat_stride + col] = __float2bfloat16_rn(acc[tt]);
}

// The cuBLASLt absorption's other half: q_lat[t, h, R:] = q_pe[t, h] (one thread per value).
__global__ void mla_copy_pe_kernel(const bf16raw* __restrict__ q, bf16raw* __restrict__ q_lat, int64_t TH, int dn,
                                   int P, int R) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < TH * P;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t th = i / P, pp = i % P;
    q_lat[th * (R + P) + R + pp] = q[th * (dn + P) + dn + pp];
  }
}

// ---------------------------------------------------------------- unabsorb
constexpr int kUnWarps = 8;   // output rows (of dv) per CTA, one per warp
constexpr int kUnTokens = 8;  // tokens per CTA

__global__ void __launch_bounds__(kUnWarps * 32)
    mla_unabsorb_kernel(const bf16raw* __restrict__ o_lat, const bf16raw* __restrict__ w, bf16raw* __restrict__ o,
                        int64_t T, int H, int dn, int dv, int R) {
  extern __shared__ __align__(16) float os[];  // [kUnTokens][R]
  const int h = blockIdx.y;
  const int64_t t0 = static_cast<int64_t>(blockIdx.z) * kUnTokens;
  const int nt = static_cast<int>(min(static_cast<int64_t>(kUnTokens), T - t0));
  for (int i = threadIdx.x; i < kUnTokens * R; i += kUnWarps * 32) {
    const int tt = i / R, r = i % R;
    os[i] = tt < nt ? __bfloat162float(o_lat[((t0 + tt) * H + h) * R + r]) : 0.f;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int vrow = blockIdx.x * kUnWarps + warp;
  if (vrow >= dv) return;
  const bf16raw* wr = w + (static_cast<int64_t>(h) * (dn + dv) + dn + vrow) * R;  // W_uv_h[vrow, :]
  float acc[kUnTokens];
#pragma unroll
  for (int tt = 0; tt < kUnTokens; ++tt) acc[tt] = 0.f;
  for (int r = lane; r < R; r += 32) {
    const float wv = __bfloat162float(wr[r]);
#pragma unroll
    for (int tt = 0; tt < kUnTokens; ++tt) acc[tt] += os[tt * R + r] * wv;
  }
#pragma unroll
  for (int tt = 0; tt < kUnTokens; ++tt) {
    const float s = warp_sum(acc[tt]);
    if (lane == 0 && tt < nt) o[((t0 + tt) * H + h) * dv + vrow] = __float2bfloat16_rn(s);
  }
}

// ---------------------------------------------------------------- lse_merge
constexpr int kMergeCols = 128;    // columns of R per CTA
constexpr int kMaxMergeParts = 4096;
constexpr int kMergeBatch = 16;  // parts whose loads are in flight together

// CTA (th, column block): the parts' lse go to shared memory in one parallel pass; their max is a block
// reduction (exact in any order), the weights exp(lse - max) are formed in parallel, and thread 0 sums
// them in the CPU's order. Group g of the G thread groups then sums its share of the parts (contiguous,
// in order) for its column, kMergeBatch loads in flight at a time, and the G partials are added in group
// order (fixed for a given D and G; it differs from the CPU's single sum only in rounding). G = 4 when the
// CTAs are few (one thread per column over ~130 splits was latency bound, ~20 us for one request at
// 8k), G = 1 when they fill the GPU (4 groups were slower there: 30 -> 46 us at 64 tokens of 33 parts).
template <int G>
__global__ void __launch_bounds__(kMergeCols * G)
    lse_merge_kernel(const float* __restrict__ o_parts, const float* __restrict__ lse_parts, int D, int64_t TH, int R,
                     float* __restrict__ o, float* __restrict__ lse) {
  constexpr int kMergeThreads = kMergeCols * G;
  extern __shared__ float mw[];  // [D] weights, [D] the parts' lse
  float* ls = mw + D;
  __shared__ float red[kMergeThreads / 32];
  __shared__ float part[G][kMergeCols];  // groups 1.. (row 0 unused)
  __shared__ float inv_sum_s;
  const int64_t th = blockIdx.x;  // t * H + h
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  float m = -INFINITY;
  for (int d = tid; d < D; d += kMergeThreads) {
    const float l = lse_parts[d * TH + th];
    ls[d] = l;
    m = fmaxf(m, l);  // a NaN lse never becomes the max (fmaxf drops it) but poisons the sum below
  }
  // any: some part is not empty (-inf); NaN counts, as on the CPU.
  bool any = false;
  for (int d = tid; d < D; d += kMergeThreads) any |= ls[d] != -INFINITY;
  any = __syncthreads_or(any);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int w = 1; w < kMergeThreads / 32; ++w) m = fmaxf(m, red[w]);
  float* oh = o + th * R;
  const int col = tid % kMergeCols, g = tid / kMergeCols;
  const int r = blockIdx.y * kMergeCols + col;
  if (!any) {
    if (g == 0 && r < R) oh[r] = 0.f;
    if (blockIdx.y == 0 && tid == 0) lse[th] = -INFINITY;
    return;
  }
  for (int d = tid; d < D; d += kMergeThreads) mw[d] = ls[d] == -INFINITY ? 0.f : expf(ls[d] - m);
  __syncthreads();
  if (tid == 0) {
    float sum = 0.f;
    for (int d = 0; d < D; ++d)
      if (ls[d] != -INFINITY) sum += mw[d];  // the CPU's order
    inv_sum_s = 1.f / sum;
    if (blockIdx.y == 0) lse[th] = m + logf(sum);
  }
  __syncthreads();
  const float inv_sum = inv_sum_s;
  const int per = (D + G - 1) / G, d_begin = min(D, g * per), d_end = min(D, d_begin + per);
  float acc = 0.f;
  if (r < R) {
    for (int d0 = d_begin; d0 < d_end; d0 += kMergeBatch) {
      float v[kMergeBatch];
#pragma unroll
      for (int u = 0; u < kMergeBatch; ++u) {
        const int d = d0 + u;
        v[u] = d < d_end && ls[d] != -INFINITY ? o_parts[(d * TH + th) * R + r] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kMergeBatch; ++u) {
        const int d = d0 + u;
        if (d < d_end && ls[d] != -INFINITY) acc += (mw[d] * inv_sum) * v[u];  // empty parts skipped entirely
      }
    }
  }
  if (g > 0) part[g][col] = acc;
  if (G > 1) __syncthreads();
  if (g == 0 && r < R) {
#pragma unroll
    for (int i = 1; i < G; ++i) acc += part[i][col];
    oh[r] = acc;
  }
}

// Few parts (D <= 32, the splits of many requests) over enough rows to fill the GPU, with R % 4 == 0 and
// 16-byte aligned o: one warp per (t, h), no barriers. Lane d holds part d's lse; every lane forms the max
// (butterfly), then the weights and their sum in the CPU's order from the lanes (the FP32 operations of
// lse_merge_kernel<1>, in its order), and sums 4 columns per 128 of every part in order, kMergeColSteps
// column steps' loads in flight together. (The CTA per (t, h) and 128 columns took 26 us at 2 parts x 256
// tokens x 12 heads, 12288 CTAs of four barriers each; this kernel 4.2 us.)
constexpr int kMergeWarpRows = 8;  // (t, h) rows per CTA, a warp each
constexpr int kMergeColSteps = 4;  // 128-column steps per pass: R <= 512 in one pass
__global__ void __launch_bounds__(kMergeWarpRows * 32)
    lse_merge_warp_kernel(const float* __restrict__ o_parts, const float* __restrict__ lse_parts, int D, int64_t TH,
                          int R, float* __restrict__ o, float* __restrict__ lse) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t th = int64_t{blockIdx.x} * kMergeWarpRows + threadIdx.x / 32;
  if (th >= TH) return;  // warp-uniform
  const float l = lane < D ? lse_parts[lane * TH + th] : -INFINITY;
  float m = l;  // a NaN lse never becomes the max (fmaxf drops it) but poisons the sum below
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  float* oh = o + th * R;
  if (!__any_sync(0xffffffffu, l != -INFINITY)) {  // every part empty (NaN counts as not empty, as on the CPU)
    for (int c = lane; c < R; c += 32) oh[c] = 0.f;
    if (lane == 0) lse[th] = -INFINITY;
    return;
  }
  const float w = l == -INFINITY ? 0.f : expf(l - m);
  float sum = 0.f;
  for (int d = 0; d < D; ++d) {
    const float wd = __shfl_sync(0xffffffffu, w, d);
    if (__shfl_sync(0xffffffffu, l, d) != -INFINITY) sum += wd;  // the CPU's order
  }
  const float inv_sum = 1.f / sum;
  if (lane == 0) lse[th] = m + logf(sum);
  for (int base = 0; base < R; base += 128 * kMergeColSteps) {  // warp-uniform trips: the shuffles need every lane
    const int c0 = base + 4 * lane;
    float4 acc[kMergeColSteps];
#pragma unroll
    for (int j = 0; j < kMergeColSteps; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int d = 0; d < D; ++d) {
      const bool live = __shfl_sync(0xffffffffu, l, d) != -INFINITY;  // empty parts skipped entirely
      const float cw = __shfl_sync(0xffffffffu, w, d) * inv_sum;
      const float* src = o_parts + (d * TH + th) * R;
      float4 v[kMergeColSteps];
#pragma unroll
      for (int j = 0; j < kMergeColSteps; ++j) {
        const int c = c0 + 128 * j;
        v[j] = live && c < R ? *reinterpret_cast<const float4*>(src + c) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      if (!live) continue;
#pragma unroll
      for (int j = 0; j < kMergeColSteps; ++j) {
        acc[j].x += cw * v[j].x;
        acc[j].y += cw * v[j].y;
        acc[j].z += cw * v[j].z;
        acc[j].w += cw * v[j].w;
      }
    }
#pragma unroll
    for (int j = 0; j < kMergeColSteps; ++j)
      if (c0 + 128 * j < R) *reinterpret_cast<float4*>(oh + c0 + 128 * j) = acc[j];
  }
}

int launch_lse_merge(const float* o_parts, const float* lse_parts, int D, int64_t T, int H, int R, float* o, float* lse,
                     cudaStream_t stream) {
  if (D < 0 || D > kMaxMergeParts || T < 0 || H <= 0 || R <= 0) return cudaErrorInvalidValue;
  const int64_t TH = T * H;
  if (TH == 0) return cudaSuccess;
  if (TH > 0x7fffffffLL) return cudaErrorInvalidValue;
  const size_t smem = sizeof(float) * 2 * static_cast<size_t>(D);
  const dim3 grid(static_cast<unsigned>(TH), static_cast<unsigned>((R + kMergeCols - 1) / kMergeCols));
  // Few CTAs: 4 thread groups per column (the warp per row was slower there: 32 parts x 8 tokens 6.4 -> 12.1 us).
  if (int64_t{grid.x} * grid.y < 4 * int64_t{detail::device_sm_count()}) {
    lse_merge_kernel<4><<<grid, kMergeCols * 4, smem, stream>>>(o_parts, lse_parts, D, TH, R, o, lse);
  } else if (D <= 32 && R % 4 == 0 && aligned16(o_parts) && aligned16(o)) {
    const int64_t blocks = (TH + kMergeWarpRows - 1) / kMergeWarpRows;
    lse_merge_warp_kernel<<<static_cast<unsigned>(blocks), kMergeWarpRows * 32, 0, stream>>>(o_parts, lse_parts, D,
                                                                                            TH, R, o, lse);
  } else {
    lse_merge_kernel<1><<<grid, kMergeCols, smem, stream>>>(o_parts, lse_parts, D, TH, R, o, lse);
  }
  return cudaGetLastError();
}

// ---------------------------------------------------------------- attend
constexpr int kBN = 64;                        // cache entries per tile
constexpr int kMaxMT = 3;                      // M tiles (16 query rows each) per CTA
constexpr int kMaxRows = 16 * kMaxMT;          // query rows per CTA
constexpr int kColWarps = 4;                   // warps per M tile, each a quarter of R in P.V
constexpr int kThreadsPerMT = 32 * kColWarps;  // blockDim.x = kThreadsPerMT * MT
constexpr int kQKWarps = kColWarps;            // the same warps in S: entries 16 w .. 16 w + 15 each
constexpr int kMaxPairs = 8;                   // 16-column pairs of R per warp: R <= 16 * 8 * 4 = 512
constexpr int kMaxR = 16 * kMaxPairs * kColWarps;
constexpr int kPS = kBN + 8;  // row stride (elements) of the P tiles: 144 B, conflict-free ldmatrix
constexpr int kSMs = 132;     // H200; the split plan's only device assumption (a heuristic)
constexpr int kMaxSplitCtas = 2 * kSMs;  // a plan with splits never launches more CTAs (bounds the scratch)
constexpr int kTile16MinGroups = 8;  // groups of <= 16 rows from this many on take the 16-row kernel (below)

static_assert(kBN == 16 * kQKWarps, "QK mapping: 16 entries per QK warp");
static_assert(2 * kBN <= kThreadsPerMT, "prologue: one thread per row index of tiles 0 and 1");

// Row stride (elements) of the Q and entry tiles: K padded to 16 (zeros), +8 elements so that
// the stride is an odd multiple of 16 bytes and the 8 rows of an ldmatrix hit 8 different banks.
__host__ __device__ inline int attend_ek16(int E) { return (E + 15) & ~15; }
__host__ __device__ inline int attend_es(int E) { return attend_ek16(E) + 8; }

// Byte offsets of the dynamic shared memory of a CTA with MT M tiles (QR = 16 MT rows).
struct AttendSmem {
  int q;        // bf16 [QR][es] query rows
  int e;        // bf16 [2][kBN][es] entry tiles (double buffered)
  int phi;      // bf16 [QR][kPS] P, BF16 high part
  int plo;      // bf16 [QR][kPS] P - high, BF16
  int rows;     // int64 [2][kBN] pool row of each entry of the next tiles (-1: zeros)
  int red_max;  // f32 [kQKWarps][QR] row max of each QK warp's 16 entries
  int red_sum;  // f32 [kQKWarps][QR] row sum of exp of each QK warp's 16 entries
  int corr;     // f32 [QR] exp(m_old - m_new) of the current tile
  int m;        // f32 [QR] final running max
  int l;        // f32 [QR] running sum of exp (updated by thread r)
  int len;      // int32 [QR] entries visible to the row
  int total;
};

__host__ __device__ inline AttendSmem attend_smem(int E, int MT) {
  const int es = attend_es(E), qr = 16 * MT;
  AttendSmem s{};
  int o = 0;
  s.q = o;
  o += 2 * qr * es;
  s.e = o;
  o += 2 * 2 * kBN * es;
  s.phi = o;
  o += 2 * qr * kPS;
  s.plo = o;
  o += 2 * qr * kPS;
  s.rows = o;
  o += 8 * 2 * kBN;
  s.red_max = o;
  o += 4 * kQKWarps * qr;
  s.red_sum = o;
  o += 4 * kQKWarps * qr;
  s.corr = o;
  o += 4 * qr;
  s.m = o;
  o += 4 * qr;
  s.l = o;
  o += 4 * qr;
  s.len = o;
  o += 4 * qr;
  s.total = o;
  return s;
}

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

AttendShape attend_shape(int rows) {
  const int mctas = std::max(1, (rows + kMaxRows - 1) / kMaxRows);
  const int per = std::max(1, (rows + mctas - 1) / mctas);
  return {mctas, per, (per + 15) / 16};
}

// Context splits per CTA row block. A split is a CTA that streams ~1/splits of the context and
// writes a partial (o / l, lse) merged by lse_merge. One CTA per SM (the shared memory of a tile
// pair), so the cost of s splits in tile times is waves x (tiles per split + 1, the start-up) plus
// the partials' traffic (rows x R floats written and read back, as a fraction of a tile), spread
// over the SMs. A plan with splits launches at most kMaxSplitCtas CTAs.
int plan_splits(int64_t ctas, int64_t max_len, int rows_per_cta, int R, int E) {
  const int64_t tiles = (max_len + kBN - 1) / kBN;
  if (tiles <= 1 || ctas <= 0) return 1;
  const int64_t smax = std::min<int64_t>(tiles, std::max<int64_t>(1, kMaxSplitCtas / ctas));
  const double split_tiles =
      2.0 * rows_per_cta * (static_cast<double>(R) + 1) * 4 / (static_cast<double>(kBN) * E * 2);
  int64_t best = 1;
  double best_cost = 0;
  for (int64_t s = 1; s <= smax; ++s) {
    const int64_t per = (tiles + s - 1) / s;
    const int64_t waves = (ctas * s + kSMs - 1) / kSMs;
    const double cost = static_cast<double>(waves * (per + 1)) +
                        (s > 1 ? static_cast<double>(ctas * s) * split_tiles / kSMs : 0.0);
    if (s == 1 || cost < best_cost - 1e-9) {
      best = s;
      best_cost = cost;
    }
  }
  return static_cast<int>(best);
}

size_t partial_bytes(int splits, int64_t T, int H, int R) {
  if (splits <= 1) return 0;
  const size_t n = static_cast<size_t>(splits) * static_cast<size_t>(T) * static_cast<size_t>(H);
  return (n * static_cast<size_t>(R) + n) * sizeof(float);
}

// Scratch for any call with at most `rows` (token, head) rows, groups of at most `group_rows` rows and
// lengths <= max_len: splits x rows <= rows x min(tiles, kMaxSplitCtas), and splits x CTAs <=
// kMaxSplitCtas with at most min(group_rows, kMaxRows) rows per CTA. The engine sizes its scratch once
// for max_batch x max_q and then runs smaller steps, whose plans split more: this bound covers them.
size_t partial_bound(int64_t rows, int group_rows, int64_t max_len, int R) {
  const int64_t tiles = (max_len + kBN - 1) / kBN;
  if (rows <= 0 || group_rows <= 0 || R <= 0 || tiles <= 1) return 0;
  const int64_t n = std::min(rows * std::min<int64_t>(tiles, kMaxSplitCtas),
                             int64_t{kMaxSplitCtas} * std::min(group_rows, kMaxRows));
  return (static_cast<size_t>(n) * static_cast<size_t>(R) + static_cast<size_t>(n)) * sizeof(float);
}

using detail::ldsm_x4;
using detail::ldsm_x4_trans;
using detail::smem_u32;
__device__ __forceinline__ uint32_t pack_bf16(bf16raw lo, bf16raw hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) | (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

using detail::cp_async16;
using detail::cp_async_commit;
using detail::mma_bf16_16816;

using detail::cp_async_wait;
using detail::cp_async_wait_all;

// S (+)= Q E^T for one M tile and the 16 entries of a warp, K = ek16 (zero padded): per pair of k steps
// two x4 of E (two n8 tiles: b0, b1 of each) and two x4 of Q; the odd k steps go to slot 1 (4
// independent accumulator chains), added at the end (FP32, another summation order). q_addr, e_addr:
// this lane's ldmatrix row addresses at k = 0.
__device__ __forceinline__ void qk_tile(float (&sv)[2][2][4], uint32_t q_addr, uint32_t e_addr, int ek16) {
  int kk = 0;
#pragma unroll 1
  for (; kk + 16 < ek16; kk += 32) {
    uint32_t b0[4], b1[4], a0[4], a1[4];
    ldsm_x4(b0, e_addr + kk * 2);
    ldsm_x4(a0, q_addr + kk * 2);
    ldsm_x4(b1, e_addr + (kk + 16) * 2);
    ldsm_x4(a1, q_addr + (kk + 16) * 2);
    mma_bf16_16816(sv[0][0], a0[0], a0[1], a0[2], a0[3], b0[0], b0[1]);
    mma_bf16_16816(sv[0][1], a0[0], a0[1], a0[2], a0[3], b0[2], b0[3]);
    mma_bf16_16816(sv[1][0], a1[0], a1[1], a1[2], a1[3], b1[0], b1[1]);
    mma_bf16_16816(sv[1][1], a1[0], a1[1], a1[2], a1[3], b1[2], b1[3]);
  }
  if (kk < ek16) {
    uint32_t b0[4], a0[4];
    ldsm_x4(b0, e_addr + kk * 2);
    ldsm_x4(a0, q_addr + kk * 2);
    mma_bf16_16816(sv[0][0], a0[0], a0[1], a0[2], a0[3], b0[0], b0[1]);
    mma_bf16_16816(sv[0][1], a0[0], a0[1], a0[2], a0[3], b0[2], b0[3]);
  }
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) sv[0][n][i] += sv[1][n][i];
}

template <bool INDEXED>
__global__ void __launch_bounds__(kThreadsPerMT * kMaxMT, 1) mla_attend_kernel(const AttendParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int H = p.H, R = p.R, E = p.R + p.P;
  const int ek16 = attend_ek16(E), es = attend_es(E);
  const int NTH = blockDim.x, MT = NTH / kThreadsPerMT, QR = 16 * MT;
  const AttendSmem lay = attend_smem(E, MT);
  bf16raw* Qs = reinterpret_cast<bf16raw*>(smem + lay.q);
  bf16raw* Es = reinterpret_cast<bf16raw*>(smem + lay.e);
  bf16raw* Phi = reinterpret_cast<bf16raw*>(smem + lay.phi);
  bf16raw* Plo = reinterpret_cast<bf16raw*>(smem + lay.plo);
  long long* rows_s = reinterpret_cast<long long*>(smem + lay.rows);
  float* red_max = reinterpret_cast<float*>(smem + lay.red_max);
  float* red_sum = reinterpret_cast<float*>(smem + lay.red_sum);
  float* corr_s = reinterpret_cast<float*>(smem + lay.corr);
  float* m_s = reinterpret_cast<float*>(smem + lay.m);
  float* l_s = reinterpret_cast<float*>(smem + lay.l);
  int* len_s = reinterpret_cast<int*>(smem + lay.len);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int64_t grp = blockIdx.z;
  const int64_t b = INDEXED ? grp / p.q_len : grp;
  const int64_t t0 = INDEXED ? grp : grp * p.q_len;
  const int rows_total = INDEXED ? H : p.q_len * H;
  const int row0 = blockIdx.x * p.rows_per_cta;
  const int nrows = min(p.rows_per_cta, rows_total - row0);
  const int64_t th0 = t0 * H + row0;  // rows are token-major: row r is (token, head) th0 + r
  const int split = blockIdx.y, nsplit = gridDim.y;
  const int64_t TH = p.T * H;

  // The query rows first (they depend on nothing; committed with tile 0), zeros in their K padding.
  const int cpr = E / 8, kc16 = ek16 / 8;  // 16-byte chunks per entry; per tile row with the K padding
  for (int i = tid; i < QR * kc16; i += NTH) {
    const int r = i / kc16, c = i - r * kc16;
    bf16raw* dst = Qs + r * es + c * 8;
    if (c < cpr) {
      const bool valid = r < nrows;
      cp_async16(dst, valid ? p.q_lat + (th0 + r) * E + c * 8 : p.q_lat, valid);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  for (int r = tid; r < QR; r += NTH) {
    int len = 0;
    if (r < nrows) {
      const int64_t tok = t0 + (row0 + r) / H;
      len = INDEXED ? p.sel_count[tok] : p.ctx_len[tok];
      len = max(0, min(len, p.max_len));
    }
    len_s[r] = len;
    l_s[r] = 0.f;
  }
  __syncthreads();
  int L = 0;
  for (int r = 0; r < QR; ++r) L = max(L, len_s[r]);
  // This split's entries [c0, c1): the rows' longest length L in nsplit chunks of whole tiles.
  const int64_t chunk = (static_cast<int64_t>(L) + nsplit - 1) / nsplit;
  const int64_t c0l = split * ((chunk + kBN - 1) / kBN * kBN);
  const int c0 = static_cast<int>(min(c0l, static_cast<int64_t>(L)));
  const int c1 = static_cast<int>(min(c0l + (chunk + kBN - 1) / kBN * kBN, static_cast<int64_t>(L)));
  if (c0 >= c1) {  // no entries: lse -inf; o zeros only where it is the final output (lse_merge skips it)
    cp_async_wait_all();  // the query copies
    for (int r = tid; r < nrows; r += NTH) p.lse_out[split * TH + th0 + r] = -INFINITY;
    if (nsplit == 1)
      for (int i = tid; i < nrows * R; i += NTH) p.o_out[th0 * R + i] = 0.f;
    return;
  }

  // Pool row of entry j of the chunk (-1: a zero entry, as an invalid page or a negative selection).
  auto entry_pos = [&](int j) -> int { return j < c1 ? (INDEXED ? p.sel[t0 * p.max_sel + j] : j) : -1; };
  auto entry_page = [&](int pos) -> int {
    if (pos < 0) return -1;
    const int pg = pos / p.page_size;
    return pg < p.max_pages ? p.tables[b * p.max_pages + pg] : -1;
  };
  auto entry_row = [&](int pos, int page) -> long long {
    return pos >= 0 && page >= 0 ? static_cast<long long>(page) * p.page_size + pos % p.page_size : -1LL;
  };

  // Row indices of tiles 0 and 1, zeros in the K padding of the entry tiles.
  if (tid < 2 * kBN) {
    const int pos = entry_pos(c0 + tid);
    rows_s[tid] = entry_row(pos, entry_page(pos));
  }
  if (ek16 != E) {  // E % 8 == 0: one 16-byte chunk per row
    for (int i = tid; i < 2 * kBN; i += NTH)
      *reinterpret_cast<uint4*>(Es + i * es + E) = make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();  // rows_s

  // Loader: chunk i = n cpr + c of a tile is copied by thread i % NTH; a warp reads 512 contiguous bytes.
  const int ld_dn = NTH / cpr, ld_dc = NTH % cpr, ld_n0 = tid / cpr, ld_c0 = tid % cpr;
  auto load_tile = [&](int buf) {
    const long long* rs = rows_s + buf * kBN;
    bf16raw* eb = Es + buf * kBN * es;
    int n = ld_n0, c = ld_c0;
    while (n < kBN) {
      const long long row = rs[n];
      const bool valid = row >= 0;
      cp_async16(eb + n * es + c * 8, valid ? p.pool + row * E + c * 8 : p.pool, valid);
      n += ld_dn;
      c += ld_dc;
      if (c >= cpr) {
        c -= cpr;
        ++n;
      }
    }
  };
  load_tile(0);
  cp_async_commit();

  // Warp (M tile pm, cq): in S the scores of its M tile's rows and entries 16 cq .. 16 cq + 15 of the
  // tile, and their softmax (the 4 warps of an M tile keep the same running max of its rows); in P.V
  // the 16-column pairs [pp0, pp0 + npw) of R for its M tile's rows.
  const int pm = warp / kColWarps, cq = warp % kColWarps;
  float m_run[2] = {-INFINITY, -INFINITY};
  const int NP = (R + 15) / 16, npw = (NP + kColWarps - 1) / kColWarps, pp0 = cq * npw;
  float acc[kMaxPairs][2][4];
#pragma unroll
  for (int i = 0; i < kMaxPairs; ++i)
#pragma unroll
    for (int n = 0; n < 2; ++n) acc[i][n][0] = acc[i][n][1] = acc[i][n][2] = acc[i][n][3] = 0.f;

  // ldmatrix lane addresses (bytes). A fragments (Q, P): row lane % 16, column 8 (lane / 16).
  // QK B (E rows = entries, non-trans): entry (lane % 8) + 8 (lane / 16), column 8 ((lane / 8) % 2).
  // PV B (E rows = entries, trans): entry (lane % 8) + 8 ((lane / 8) % 2), column 8 (lane / 16).
  const uint32_t q_addr = smem_u32(Qs) + ((16 * pm + (lane & 15)) * es + (lane >> 4) * 8) * 2;
  const uint32_t qk_b_addr =
      smem_u32(Es) + ((16 * cq + (lane & 7) + ((lane >> 4) << 3)) * es + ((lane >> 3) & 1) * 8) * 2;
  const uint32_t pa_off = ((16 * pm + (lane & 15)) * kPS + (lane >> 4) * 8) * 2;
  const uint32_t phi_addr = smem_u32(Phi) + pa_off, plo_addr = smem_u32(Plo) + pa_off;
  const uint32_t pv_b_addr = smem_u32(Es) + (((lane & 7) + ((lane >> 3) & 1) * 8) * es + (lane >> 4) * 8) * 2;

  int it = 0;
  for (int j0 = c0; j0 < c1; j0 += kBN, ++it) {
    const int buf = it & 1;
    if (j0 + kBN < c1) load_tile(buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of tile `it` have landed
    __syncthreads();    // B0: tile `it` complete; every warp is past the previous P.V
    const uint32_t tile_off = static_cast<uint32_t>(buf * kBN * es * 2);

    // Row lookup of tile it + 2 (into rows_s[buf], read when tile it + 1 is current), in three steps
    // spread over this tile's math so that its global loads are not waited for.
    const int look_pos = tid < kBN ? entry_pos(j0 + 2 * kBN + tid) : -1;

    // S of this warp's M tile (2 chains per n8 tile, summed into sv[0]), then the masked scaled scores, then p.
    float sv[2][2][4];
    {
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int n = 0; n < 2; ++n) sv[c][n][0] = sv[c][n][1] = sv[c][n][2] = sv[c][n][3] = 0.f;
      qk_tile(sv, q_addr, qk_b_addr + tile_off, ek16);
      // Scale, mask (entry j visible to row r iff j < min(len_r, c1)), the row max of these 16 entries.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * pm + 8 * h + g;
        const int lim = min(len_s[r], c1);
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int j = j0 + 16 * cq + 8 * n + 2 * tq + c;
            const float v = j < lim ? p.scale * sv[0][n][2 * h + c] : -INFINITY;
            sv[0][n][2 * h + c] = v;
            mx = fmaxf(mx, v);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (tq == 0) red_max[cq * QR + r] = mx;
      }
    }
    __syncthreads();  // B1: red_max

    // Online softmax, FP32: every thread forms the tile max of its rows from the 4 partial maxima (the
    // same values in the same order in each warp of the M tile, so their running maxima agree), writes
    // p = exp(s - m) as BF16 hi + lo and the partial row sums; warp cq = 0 of the M tile publishes the
    // correction.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * pm + 8 * h + g;
      const float tmax = fmaxf(fmaxf(red_max[r], red_max[QR + r]), fmaxf(red_max[2 * QR + r], red_max[3 * QR + r]));
      const float m_new = fmaxf(m_run[h], tmax);
      float corr = 1.f, pv[4] = {0.f, 0.f, 0.f, 0.f};
      if (m_new != -INFINITY) {
        corr = expf(m_run[h] - m_new);
        pv[0] = expf(sv[0][0][2 * h] - m_new);
        pv[1] = expf(sv[0][0][2 * h + 1] - m_new);
        pv[2] = expf(sv[0][1][2 * h] - m_new);
        pv[3] = expf(sv[0][1][2 * h + 1] - m_new);
      }
      m_run[h] = m_new;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const bf16raw h0 = __float2bfloat16_rn(pv[2 * n]), h1 = __float2bfloat16_rn(pv[2 * n + 1]);
        const bf16raw l0 = __float2bfloat16_rn(pv[2 * n] - __bfloat162float(h0));
        const bf16raw l1 = __float2bfloat16_rn(pv[2 * n + 1] - __bfloat162float(h1));
        const int col = 16 * cq + 8 * n + 2 * tq;
        *reinterpret_cast<uint32_t*>(Phi + r * kPS + col) = pack_bf16(h0, h1);
        *reinterpret_cast<uint32_t*>(Plo + r * kPS + col) = pack_bf16(l0, l1);
      }
      float psum = (pv[0] + pv[1]) + (pv[2] + pv[3]);
      psum += __shfl_xor_sync(0xffffffffu, psum, 1);
      psum += __shfl_xor_sync(0xffffffffu, psum, 2);
      if (tq == 0) {
        red_sum[cq * QR + r] = psum;
        if (cq == 0) corr_s[r] = corr;
      }
    }
    const int look_page = tid < kBN ? entry_page(look_pos) : -1;
    __syncthreads();  // B2: P, red_sum, corr_s

    if (tid < QR)
      l_s[tid] = l_s[tid] * corr_s[tid] +
                 ((red_sum[tid] + red_sum[QR + tid]) + (red_sum[2 * QR + tid] + red_sum[3 * QR + tid]));

    // O = corr O + P E[:, :R] with P = hi + lo (two MMAs per B fragment).
    {
      const float cg = corr_s[16 * pm + g], cg8 = corr_s[16 * pm + g + 8];
#pragma unroll
      for (int i = 0; i < kMaxPairs; ++i)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          acc[i][n][0] *= cg;
          acc[i][n][1] *= cg;
          acc[i][n][2] *= cg8;
          acc[i][n][3] *= cg8;
        }
#pragma unroll  // the 4 k steps unrolled: P and E fragments load ahead of their MMAs (unroll 1: 9% slower at 64 x q 4)
      for (int ks = 0; ks < kBN; ks += 16) {
        uint32_t ah[4], al[4];
        ldsm_x4(ah, phi_addr + ks * 2);
        ldsm_x4(al, plo_addr + ks * 2);
        // Two pairs at a time, the hi products before the lo ones: an accumulator's next MMA is 4 MMAs
        // after its previous one (hi, lo back to back waited on each other).
#pragma unroll
        for (int i0 = 0; i0 < kMaxPairs; i0 += 2) {
          uint32_t bv[2][4];
#pragma unroll
          for (int d = 0; d < 2; ++d)
            if (i0 + d < npw && pp0 + i0 + d < NP)
              ldsm_x4_trans(bv[d], pv_b_addr + tile_off + (ks * es + 16 * (pp0 + i0 + d)) * 2);
#pragma unroll
          for (int part = 0; part < 2; ++part) {
            const uint32_t* a = part == 0 ? ah : al;
#pragma unroll
            for (int d = 0; d < 2; ++d)
              if (i0 + d < npw && pp0 + i0 + d < NP) {
                mma_bf16_16816(acc[i0 + d][0], a[0], a[1], a[2], a[3], bv[d][0], bv[d][1]);
                mma_bf16_16816(acc[i0 + d][1], a[0], a[1], a[2], a[3], bv[d][2], bv[d][3]);
              }
          }
        }
      }
    }
    if (tid < kBN) rows_s[buf * kBN + tid] = entry_row(look_pos, look_page);
    __syncthreads();  // B3: the next iteration's copy overwrites this tile; rows_s of tile it + 2
  }

  if (cq == 0 && tq == 0) {
    m_s[16 * pm + g] = m_run[0];
    m_s[16 * pm + 8 + g] = m_run[1];
  }
  __syncthreads();

  const bool pairs = (R & 1) == 0 && (reinterpret_cast<uintptr_t>(p.o_out) & 7u) == 0;  // float2 stores
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * pm + 8 * h + g;
    if (r >= nrows) continue;
    const float l = l_s[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* orow = p.o_out + (split * TH + th0 + r) * R;
#pragma unroll
    for (int i = 0; i < kMaxPairs; ++i) {
      if (i < npw && pp0 + i < NP) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const int col = 16 * (pp0 + i) + 8 * n + 2 * tq;
          const float v0 = acc[i][n][2 * h] * inv, v1 = acc[i][n][2 * h + 1] * inv;
          if (pairs && col + 1 < R) {
            *reinterpret_cast<float2*>(orow + col) = make_float2(v0, v1);
          } else {
            if (col < R) orow[col] = v0;
            if (col + 1 < R) orow[col + 1] = v1;
          }
        }
      }
    }
  }
  if (tid < nrows) {
    const float l = l_s[tid];
    p.lse_out[split * TH + th0 + tid] = l > 0.f ? m_s[tid] + logf(l) : -INFINITY;
  }
}

// ---------------------------------------------------------------- attend, 16-row tiles
// The earlier kernel, kept for many groups of at most 16 rows (q = 1 decode of many requests, DSA over
// many tokens), where it measured faster on the H200 (MLA 8192 x 32 requests: 219 vs 263 us; 65536 x 8:
// 301 vs 514 us): a CTA of 4 warps owns 16 query rows and one chunk of a context in 32-entry tiles
// (46 KiB of shared memory, several CTAs per SM), S through shared memory, P.V fragments gathered
// element-wise. Same partial outputs and merge as above.
namespace tile16 {
constexpr int kAttWarps = 4;
constexpr int kAttThreads = kAttWarps * 32;
constexpr int kBN = 32;       // cache entries per tile
constexpr int kMRows = 16;    // query rows per CTA (one MMA M tile)
constexpr int kPS = kBN + 8;  // row stride (elements) of the P tiles
constexpr int kSS = kBN + 4;  // row stride (floats) of the score tile
constexpr int kMaxNTW = 16;   // n8 tiles of R per warp: R <= 8 * 16 * 4 = 512
constexpr int kMinChunkTiles = 4;     // a split covers at least 128 entries
constexpr int kTargetCtas = 2 * 132;  // ~2 waves on an H200 (heuristic only)

static_assert(kAttThreads == kMRows * 8, "softmax mapping: 8 threads per row, 4 columns each");
static_assert(kAttThreads == kBN * 4, "loader mapping: 4 threads per entry");
static_assert(kBN == 8 * kAttWarps, "QK mapping: one n8 tile of entries per warp");

inline size_t attend_smem_bytes(int E) {
  const size_t ek = static_cast<size_t>(attend_es(E));
  return 2 * (kMRows * ek + 2 * kBN * ek + 2 * kMRows * kPS) + 4 * (kMRows * kSS + 3 * kMRows) + 4 * kMRows;
}

struct SplitPlan {
  int splits;
  int chunk;
};

SplitPlan plan_splits(int64_t ctas, int64_t max_len) {
  const int64_t tiles = (max_len + kBN - 1) / kBN;
  if (tiles <= 0) return {1, kBN};
  const int64_t want = (kTargetCtas + ctas - 1) / std::max<int64_t>(ctas, 1);
  const int64_t cap = std::max<int64_t>(1, tiles / kMinChunkTiles);
  // At most kTargetCtas CTAs with splits (so the partials stay inside partial_bound's scratch).
  const int64_t s0 = std::max<int64_t>(1, std::min({want, cap, kTargetCtas / std::max<int64_t>(ctas, 1)}));
  const int64_t chunk_tiles = (tiles + s0 - 1) / s0;
  return {static_cast<int>((tiles + chunk_tiles - 1) / chunk_tiles), static_cast<int>(chunk_tiles * kBN)};
}

using detail::ld_u32;

template <bool INDEXED>
__global__ void __launch_bounds__(kAttThreads) mla_attend16_kernel(const AttendParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int E = p.R + p.P;
  const int ek16 = attend_ek16(E), ek = attend_es(E);
  bf16raw* Qs = reinterpret_cast<bf16raw*>(smem);            // [16][ek]
  bf16raw* Es = Qs + kMRows * ek;                            // [2][kBN][ek]
  bf16raw* Phi = Es + 2 * kBN * ek;                          // [16][kPS]
  bf16raw* Plo = Phi + kMRows * kPS;                         // [16][kPS]
  float* Ss = reinterpret_cast<float*>(Plo + kMRows * kPS);  // [16][kSS]
  float* corr_s = Ss + kMRows * kSS;
  float* m_s = corr_s + kMRows;
  float* l_s = m_s + kMRows;
  int* len_s = reinterpret_cast<int*>(l_s + kMRows);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int H = p.H, R = p.R;
  const int G = INDEXED ? 1 : p.q_len;  // tokens sharing the entries of this CTA
  const int64_t grp = blockIdx.z;
  const int64_t b = INDEXED ? grp / p.q_len : grp;
  const int64_t t0 = INDEXED ? grp : grp * p.q_len;
  const int rows_total = G * H;
  const int mrow0 = blockIdx.x * kMRows;
  const int split = blockIdx.y;

  if (tid < kMRows) {
    const int rr = mrow0 + tid;
    int len = 0;
    if (rr < rows_total) {
      const int64_t tok = t0 + rr / H;
      len = INDEXED ? p.sel_count[tok] : p.ctx_len[tok];
      len = max(0, min(len, p.max_len));
    }
    len_s[tid] = len;
  }
  const int cpr = E / 8;  // 16-byte chunks per entry
  for (int i = tid; i < kMRows * (ek16 / 8); i += kAttThreads) {
    const int r = i / (ek16 / 8), c = i % (ek16 / 8);
    const int rr = mrow0 + r;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (rr < rows_total && c < cpr) {
      const int64_t tok = t0 + rr / H;
      val = *reinterpret_cast<const uint4*>(p.q_lat + (tok * H + rr % H) * E + c * 8);
    }
    *reinterpret_cast<uint4*>(Qs + r * ek + c * 8) = val;
  }
  if (ek16 != E) {  // the K padding of the entry tiles (E % 8 == 0: one 16-byte chunk per row)
    for (int i = tid; i < 2 * kBN; i += kAttThreads)
      *reinterpret_cast<uint4*>(Es + i * ek + E) = make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();

  int L = 0;
#pragma unroll
  for (int r = 0; r < kMRows; ++r) L = max(L, len_s[r]);
  const int c0 = split * p.chunk;
  const int c1 = min(c0 + p.chunk, L);
  const int lim_g = min(len_s[g], c1), lim_g8 = min(len_s[g + 8], c1);

  // Loader: thread -> entry tid / 4 of the tile, 16-byte chunks tid % 4, +4, ...
  auto load_tile = [&](int j0, int buf) {
    const int n = tid >> 2, part0 = tid & 3;
    const int j = j0 + n;
    bool valid = j < c1;
    const bf16raw* src = p.pool;
    if (valid) {
      const int pos = INDEXED ? p.sel[t0 * p.max_sel + j] : j;
      const int pg = pos >= 0 ? pos / p.page_size : -1;
      valid = pos >= 0 && pg < p.max_pages;
      if (valid) {
        const int64_t page = p.tables[b * p.max_pages + pg];
        valid = page >= 0;
        if (valid) src = p.pool + (page * p.page_size + pos % p.page_size) * E;
      }
    }
    bf16raw* dst = Es + (buf * kBN + n) * ek;
    for (int c = part0; c < cpr; c += 4) cp_async16(dst + c * 8, valid ? src + c * 8 : p.pool, valid);
  };

  const int sr = tid >> 3, sub = tid & 7;  // softmax: row sr, columns 4 sub .. 4 sub + 3
  float m_run = -INFINITY, l_run = 0.f;
  const int NT = (R + 7) / 8;
  const int ntw = (NT + kAttWarps - 1) / kAttWarps;
  float acc[kMaxNTW][4];
#pragma unroll
  for (int i = 0; i < kMaxNTW; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  if (c0 < c1) load_tile(c0, 0);
  cp_async_commit();
  int it = 0;
  for (int j0 = c0; j0 < c1; j0 += kBN, ++it) {
    const int buf = it & 1;
    if (j0 + kBN < c1) load_tile(j0 + kBN, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // the tile of this iteration has landed
    __syncthreads();
    const bf16raw* Eb = Es + buf * kBN * ek;

    // S = scale Q E^T: warp w computes the 16 x 8 block of entries 8w .. 8w+7.
    {
      float sc[4] = {0.f, 0.f, 0.f, 0.f};
      const bf16raw* Ew = Eb + (warp * 8 + g) * ek + 2 * tq;
      const bf16raw* Qg = Qs + g * ek + 2 * tq;
      const bf16raw* Qg8 = Qs + (g + 8) * ek + 2 * tq;
      for (int kk = 0; kk < ek16; kk += 16) {
        mma_bf16_16816(sc, ld_u32(Qg + kk), ld_u32(Qg8 + kk), ld_u32(Qg + kk + 8), ld_u32(Qg8 + kk + 8),
                       ld_u32(Ew + kk), ld_u32(Ew + kk + 8));
      }
      const int col = warp * 8 + 2 * tq;
      const int j = j0 + col;
      Ss[g * kSS + col] = j < lim_g ? p.scale * sc[0] : -INFINITY;
      Ss[g * kSS + col + 1] = j + 1 < lim_g ? p.scale * sc[1] : -INFINITY;
      Ss[(g + 8) * kSS + col] = j < lim_g8 ? p.scale * sc[2] : -INFINITY;
      Ss[(g + 8) * kSS + col + 1] = j + 1 < lim_g8 ? p.scale * sc[3] : -INFINITY;
    }
    __syncthreads();

    // Online softmax, FP32: 8 threads per row.
    {
      const float4 s4 = *reinterpret_cast<const float4*>(Ss + sr * kSS + sub * 4);
      float tmax = fmaxf(fmaxf(s4.x, s4.y), fmaxf(s4.z, s4.w));
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 4));
      const float m_new = fmaxf(m_run, tmax);
      float corr = 1.f, pv[4] = {0.f, 0.f, 0.f, 0.f};
      if (m_new != -INFINITY) {
        corr = expf(m_run - m_new);
        pv[0] = expf(s4.x - m_new);
        pv[1] = expf(s4.y - m_new);
        pv[2] = expf(s4.z - m_new);
        pv[3] = expf(s4.w - m_new);
      }
      float psum = (pv[0] + pv[1]) + (pv[2] + pv[3]);
      psum += __shfl_xor_sync(0xffffffffu, psum, 1);
      psum += __shfl_xor_sync(0xffffffffu, psum, 2);
      psum += __shfl_xor_sync(0xffffffffu, psum, 4);
      l_run = l_run * corr + psum;
      m_run = m_new;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bf16raw hi = __float2bfloat16_rn(pv[i]);
        Phi[sr * kPS + sub * 4 + i] = hi;
        Plo[sr * kPS + sub * 4 + i] = __float2bfloat16_rn(pv[i] - __bfloat162float(hi));
      }
      if (sub == 0) corr_s[sr] = corr;
    }
    __syncthreads();

    // O = corr O + P E[:, :R]: warp w owns n8 tiles [w ntw, (w+1) ntw) of R.
    {
      const float cg = corr_s[g], cg8 = corr_s[g + 8];
#pragma unroll
      for (int i = 0; i < kMaxNTW; ++i) {
        acc[i][0] *= cg;
        acc[i][1] *= cg;
        acc[i][2] *= cg8;
        acc[i][3] *= cg8;
      }
#pragma unroll
      for (int ks = 0; ks < kBN; ks += 16) {
        const bf16raw* Pg = Phi + g * kPS + ks + 2 * tq;
        const bf16raw* Pg8 = Phi + (g + 8) * kPS + ks + 2 * tq;
        const uint32_t h0 = ld_u32(Pg), h1 = ld_u32(Pg8), h2 = ld_u32(Pg + 8), h3 = ld_u32(Pg8 + 8);
        const bf16raw* Lg = Plo + g * kPS + ks + 2 * tq;
        const bf16raw* Lg8 = Plo + (g + 8) * kPS + ks + 2 * tq;
        const uint32_t l0 = ld_u32(Lg), l1 = ld_u32(Lg8), l2 = ld_u32(Lg + 8), l3 = ld_u32(Lg8 + 8);
        const bf16raw* E0 = Eb + (ks + 2 * tq) * ek;  // entry rows ks+2t, +1, +8, +9
#pragma unroll
        for (int i = 0; i < kMaxNTW; ++i) {
          const int nt = warp * ntw + i;
          if (i < ntw && nt < NT) {
            const int col = nt * 8 + g;
            const uint32_t b0 = pack_bf16(E0[col], E0[ek + col]);
            const uint32_t b1 = pack_bf16(E0[8 * ek + col], E0[9 * ek + col]);
            mma_bf16_16816(acc[i], h0, h1, h2, h3, b0, b1);
            mma_bf16_16816(acc[i], l0, l1, l2, l3, b0, b1);
          }
        }
      }
    }
    __syncthreads();  // the next iteration overwrites Ss, P and the other entry buffer
  }

  if (sub == 0) {
    m_s[sr] = m_run;
    l_s[sr] = l_run;
  }
  __syncthreads();

  const int64_t TH = p.T * H;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = g + 8 * half;
    const int rr = mrow0 + row;
    if (rr >= rows_total) continue;
    const int64_t tok = t0 + rr / H;
    const float l = l_s[row];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* orow = p.o_out + (static_cast<int64_t>(split) * TH + tok * H + rr % H) * R;
#pragma unroll
    for (int i = 0; i < kMaxNTW; ++i) {
      const int nt = warp * ntw + i;
      if (i < ntw && nt < NT) {
        const int col = nt * 8 + 2 * tq;
        if (col < R) orow[col] = acc[i][2 * half] * inv;
        if (col + 1 < R) orow[col + 1] = acc[i][2 * half + 1] * inv;
      }
    }
  }
  if (tid < kMRows) {
    const int rr = mrow0 + tid;
    if (rr < rows_total) {
      const int64_t tok = t0 + rr / H;
      const float l = l_s[tid];
      p.lse_out[static_cast<int64_t>(split) * TH + tok * H + rr % H] = l > 0.f ? m_s[tid] + logf(l) : -INFINITY;
    }
  }
}


// The caller (launch_attend below) has checked p.
template <bool INDEXED>
int launch(AttendParams p, int64_t groups, int rows_per_group, void* scratch, size_t scratch_bytes, float* o_lat,
           float* lse, cudaStream_t stream) {
  const int E = p.R + p.P;
  const int mtiles = (rows_per_group + kMRows - 1) / kMRows;
  const SplitPlan sp = plan_splits(groups * mtiles, p.max_len);
  const size_t need = partial_bytes(sp.splits, p.T, p.H, p.R);
  if (need > 0 && (scratch == nullptr || scratch_bytes < need)) return cudaErrorInvalidValue;
  float* o_parts = o_lat;
  float* lse_parts = lse;
  if (sp.splits > 1) {
    o_parts = static_cast<float*>(scratch);
    lse_parts = o_parts + static_cast<size_t>(sp.splits) * static_cast<size_t>(p.T) * p.H * p.R;
  }
  p.o_out = o_parts;
  p.lse_out = lse_parts;
  p.chunk = sp.chunk;
  const size_t smem = attend_smem_bytes(E);
  cudaError_t err = allow_optin_smem<mla_attend16_kernel<INDEXED>>();
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(mtiles), static_cast<unsigned>(sp.splits), static_cast<unsigned>(groups));
  mla_attend16_kernel<INDEXED><<<grid, kAttThreads, smem, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || sp.splits <= 1) return err;
  return launch_lse_merge(o_parts, lse_parts, sp.splits, p.T, p.H, p.R, o_lat, lse, stream);
}


}  // namespace tile16

template <bool INDEXED>
int launch_attend(AttendParams p, int64_t groups, int rows_per_group, void* scratch, size_t scratch_bytes, float* o_lat,
                  float* lse, cudaStream_t stream) {
  const int E = p.R + p.P;
  if (p.H <= 0 || p.R <= 0 || p.R > kMaxR || p.P < 0 || E % 8 != 0 || p.page_size <= 0 || p.max_pages < 0 ||
      p.max_len < 0 || p.T < 0 || groups > 65535 || !aligned16(p.q_lat) || !aligned16(p.pool))
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  if (rows_per_group <= 16 && groups >= kTile16MinGroups) {
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
  const size_t smem = static_cast<size_t>(attend_smem(E, sh.mt).total);
  cudaError_t err = allow_optin_smem<mla_attend_kernel<INDEXED>>();
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(sh.mctas), static_cast<unsigned>(splits), static_cast<unsigned>(groups));
  mla_attend_kernel<INDEXED><<<grid, kThreadsPerMT * sh.mt, smem, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || splits <= 1) return err;
  return launch_lse_merge(o_parts, lse_parts, splits, p.T, p.H, p.R, o_lat, lse, stream);
}

}  // namespace

int mla_absorb_q(const Context& ctx, const bf16* q, const bf16* w_kvb, bf16* q_lat, int64_t T, int H, int dn, int P,
                 int dv, int R, LinearPath path) {
  if (T < 0 || H <= 0 || dn <= 0 || P < 0 || dv <= 0 || R <= 0 || H > 65535) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const auto stream = reinterpret_cast<cudaStream_t>(ctx.stream);
  const auto* qp = reinterpret_cast<const bf16raw*>(q);
  auto* lp = reinterpret_cast<bf16raw*>(q_lat);
  // Head h: q_lat[:, h, :R] [T, R] = q_nope[:, h] [T, dn] W_uk_h [dn, R].
  if (path != LinearPath::Kernel &&
      linear_batched_cublaslt(ctx, q, int64_t{H} * (dn + P), dn + P, w_kvb, R, int64_t{dn + dv} * R, false, q_lat,
                              int64_t{H} * (R + P), R + P, T, dn, R, H)) {
    if (P == 0) return cudaGetLastError();
    const int64_t n = T * H * P;
    mla_copy_pe_kernel<<<static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, stream>>>(
        qp, lp, T * H, dn, P, R);
    return cudaGetLastError();
  }
  const int64_t tiles = (T + kAbsTokens - 1) / kAbsTokens;
  if (tiles > 65535) return cudaErrorInvalidValue;
  const size_t smem = sizeof(float) * kAbsTokens * static_cast<size_t>((dn + 3) & ~3);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((R + kAbsThreads - 1) / kAbsThreads), static_cast<unsigned>(H),
                  static_cast<unsigned>(tiles));
  mla_absorb_q_kernel<<<grid, kAbsThreads, smem, stream>>>(qp, reinterpret_cast<const bf16raw*>(w_kvb), lp, T, H, dn,
                                                           P, dv, R);
  return cudaGetLastError();
}

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

int lse_merge(const float* o_parts, const float* lse_parts, int D, int64_t T, int H, int R, float* o, float* lse,
              CUstream_st* stream) {
  return launch_lse_merge(o_parts, lse_parts, D, T, H, R, o, lse, stream);
}

int mla_unabsorb(const Context& ctx, const bf16* o_lat, const bf16* w_kvb, bf16* o, int64_t T, int H, int dn, int dv,
                 int R, LinearPath path) {
  if (T < 0 || H <= 0 || dn <= 0 || dv <= 0 || R <= 0 || H > 65535) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  // Head h: o[:, h] [T, dv] = o_lat[:, h] [T, R] W_uv_h^T (W_uv_h [dv, R]).
  if (path != LinearPath::Kernel &&
      linear_batched_cublaslt(ctx, o_lat, int64_t{H} * R, R, w_kvb + int64_t{dn} * R, R, int64_t{dn + dv} * R, true,
                              o, int64_t{H} * dv, dv, T, R, dv, H))
    return cudaGetLastError();
  const int64_t tiles = (T + kUnTokens - 1) / kUnTokens;
  const size_t smem = sizeof(float) * kUnTokens * static_cast<size_t>(R);
  if (tiles > 65535 || smem > 48 * 1024) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((dv + kUnWarps - 1) / kUnWarps), static_cast<unsigned>(H),
                  static_cast<unsigned>(tiles));
  mla_unabsorb_kernel<<<grid, kUnWarps * 32, smem, reinterpret_cast<cudaStream_t>(ctx.stream)>>>(
      reinterpret_cast<const bf16raw*>(o_lat), reinterpret_cast<const bf16raw*>(w_kvb),
      reinterpret_cast<bf16raw*>(o), T, H, dn, dv, R);
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
