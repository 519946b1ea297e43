// CUDA kernels of lse_merge (see mla.h for the math): D partial attention results (o_i, lse_i) of the
// same (token, head) -> out = sum_i exp(lse_i - L) o_i with L = log sum_i exp(lse_i), lse = L; parts with
// lse = -inf (empty) are skipped, none left gives zeros and -inf. It merges the DCP shards' partials
// (the engine) and the context splits of mla_attend_paged / mla_attend_indexed (mla_attend*.cu).
//
//   lse_merge_many_kernel: few (token, head) rows (a long context's many splits): a CTA per (token, head,
//     32 columns), 16 warps over the parts, the weights' sum and the warps' partials in a fixed order.
//   lse_merge_warp_kernel: few parts over many rows, one warp per (token, head).
//   lse_merge_kernel<1>: the rest, one CTA per (token, head, 128 columns); weights exp(lse_i - max) / sum
//     as the CPU (the sum in its order).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ops/cuda_device.cuh"
#include "ops/mla.h"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;

// ---------------------------------------------------------------- lse_merge
constexpr int kMergeCols = 128;    // columns of R per CTA
constexpr int kMaxMergeParts = 4096;
constexpr int kMergeBatch = 16;  // parts whose loads are in flight together

// CTA (th, column block): the parts' lse go to shared memory in one parallel pass; their max is a block
// reduction (exact in any order), the weights exp(lse - max) are formed in parallel, and thread 0 sums
// them in the CPU's order. Group g of the G thread groups then sums its share of the parts (contiguous,
// in order) for its column, kMergeBatch loads in flight at a time, and the G partials are added in group
// order (fixed for a given D and G; it differs from the CPU's single sum only in rounding). Launched with
// G = 1 (the CTAs fill the GPU there; few CTAs take lse_merge_many_kernel).
template <int G>
__global__ void __launch_bounds__(kMergeCols * G)
    lse_merge_kernel(const float* __restrict__ o_parts, const float* __restrict__ lse_parts, int D, int64_t TH, int R,
                     float* __restrict__ o, float* __restrict__ lse) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  constexpr int kMergeThreads = kMergeCols * G;
  extern __shared__ float mw[];  // [D] weights, [D] the parts' lse
  float* ls = mw + D;
  __shared__ float red[kMergeThreads / 32];
  __shared__ float part[G][kMergeCols];  // groups 1.. (row 0 unused)
  __shared__ float inv_sum_s;
  const int64_t th = blockIdx.x;  // t * H + h
  const int tid = static_cast<int>(threadIdx.x);
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
  m = detail::block_max(m, red);
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
// column steps' loads in flight together. (With few parts the CTA per (t, h) and 128 columns is mostly its
// four barriers; a warp per row needs none.)
constexpr int kMergeWarpRows = 8;  // (t, h) rows per CTA, a warp each
constexpr int kMergeColSteps = 4;  // 128-column steps per pass: R <= 512 in one pass
__global__ void __launch_bounds__(kMergeWarpRows * 32)
    lse_merge_warp_kernel(const float* __restrict__ o_parts, const float* __restrict__ lse_parts, int D, int64_t TH,
                          int R, float* __restrict__ o, float* __restrict__ lse) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
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

// Few (t, h) rows, any number of parts (a long context's splits: one request at 8k has ~130): a CTA per
// (t, h) and 32 columns, 16 warps over the parts. The lse go to shared memory; their max (exact in any
// order) and the sum of the weights exp(lse_d - max) (a fixed tree: per thread in part order, then the
// warps' butterfly and the warps in order) come from every thread; warp w sums parts w, w + 16, ... for
// its 32 columns (one 128-byte load per part and warp, kManyBatch loads in flight per thread), and warp 0
// adds the 16 partials in warp order. (lse_merge_kernel here: a thread per column summed a long serial
// chain of loads and thread 0 the weights one by one, ~9 us at 132 parts.)
constexpr int kManyCols = 32, kManyWarps = 16, kManyThreads = kManyCols * kManyWarps, kManyBatch = 16;
__global__ void __launch_bounds__(kManyThreads)
    lse_merge_many_kernel(const float* __restrict__ o_parts, const float* __restrict__ lse_parts, int D, int64_t TH,
                          int R, float* __restrict__ o, float* __restrict__ lse) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  extern __shared__ float mw[];  // [D] weights (0: empty part)
  __shared__ float red[kManyWarps];
  __shared__ float part[kManyWarps][kManyCols];
  const int64_t th = blockIdx.x;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  float m = -INFINITY;
  bool any = false;
  for (int d = tid; d < D; d += kManyThreads) {
    const float l = lse_parts[d * TH + th];
    mw[d] = l;
    m = fmaxf(m, l);  // a NaN lse never becomes the max (fmaxf drops it) but poisons the sum below
    any |= l != -INFINITY;  // NaN counts as not empty, as on the CPU
  }
  any = __syncthreads_or(any);
  m = detail::block_max(m, red);
  float* oh = o + th * R;
  const int col = static_cast<int>(blockIdx.y) * kManyCols + lane;
  if (!any) {
    if (warp == 0 && col < R) oh[col] = 0.f;
    if (blockIdx.y == 0 && tid == 0) lse[th] = -INFINITY;
    return;
  }
  float sum = 0.f;
  for (int d = tid; d < D; d += kManyThreads) {
    const float l = mw[d];
    const float w = l == -INFINITY ? 0.f : expf(l - m);
    mw[d] = w;
    sum += w;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  __syncthreads();  // every red[] read above is done; mw holds the weights
  if (lane == 0) red[warp] = sum;
  __syncthreads();
  sum = 0.f;
#pragma unroll
  for (int w = 0; w < kManyWarps; ++w) sum += red[w];
  const float inv_sum = 1.f / sum;
  if (blockIdx.y == 0 && tid == 0) lse[th] = m + logf(sum);
  float acc = 0.f;
  if (col < R) {
    for (int d0 = warp; d0 < D; d0 += kManyWarps * kManyBatch) {
      float v[kManyBatch];
#pragma unroll
      for (int u = 0; u < kManyBatch; ++u) {
        const int d = d0 + u * kManyWarps;
        v[u] = d < D && mw[d] != 0.f ? o_parts[(d * TH + th) * R + col] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kManyBatch; ++u) {
        const int d = d0 + u * kManyWarps;
        if (d < D && mw[d] != 0.f) acc += (mw[d] * inv_sum) * v[u];  // empty parts skipped entirely
      }
    }
  }
  part[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && col < R) {
    float t = part[0][lane];
#pragma unroll
    for (int w = 1; w < kManyWarps; ++w) t += part[w][lane];
    oh[col] = t;
  }
}

}  // namespace

int lse_merge(const float* o_parts, const float* lse_parts, int D, int64_t T, int H, int R, float* o, float* lse,
              CUstream_st* stream) {
  if (D < 0 || D > kMaxMergeParts || T < 0 || H <= 0 || R <= 0) return cudaErrorInvalidValue;
  const int64_t TH = T * H;
  if (TH == 0) return cudaSuccess;
  if (TH > 0x7fffffffLL) return cudaErrorInvalidValue;
  const size_t smem = sizeof(float) * 2 * static_cast<size_t>(D);
  const dim3 grid(static_cast<unsigned>(TH), static_cast<unsigned>((R + kMergeCols - 1) / kMergeCols));
  // Few CTAs: a CTA per (t, h) and 32 columns, 16 warps over the parts (a warp per row, or a thread per
  // column and row, would leave most of the GPU idle there).
  if (int64_t{grid.x} * grid.y < 4 * int64_t{detail::device_sm_count()}) {
    const dim3 many(static_cast<unsigned>(TH), static_cast<unsigned>((R + kManyCols - 1) / kManyCols));
    return detail::launch(lse_merge_many_kernel, many, kManyThreads, sizeof(float) * static_cast<size_t>(D), stream,
                          o_parts, lse_parts, D, TH, R, o, lse);
  }
  if (D <= 32 && R % 4 == 0 && aligned16(o_parts) && aligned16(o)) {
    const int64_t blocks = (TH + kMergeWarpRows - 1) / kMergeWarpRows;
    return detail::launch(lse_merge_warp_kernel, static_cast<unsigned>(blocks), kMergeWarpRows * 32, 0, stream, o_parts,
                          lse_parts, D, TH, R, o, lse);
  }
  return detail::launch(lse_merge_kernel<1>, grid, kMergeCols, smem, stream, o_parts, lse_parts, D, TH, R, o, lse);
}

}  // namespace k3::ops::cuda
