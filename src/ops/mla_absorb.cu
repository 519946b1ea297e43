// CUDA kernels of the MLA absorption and unabsorption (see mla.h for the math):
//   absorb:   q_lat[t, h] = [bf16(W_uk_h^T q_nope[t, h]), q_pe[t, h]]
//   unabsorb: o[t, h] = bf16(W_uv_h o_lat[t, h])
//
//   mla_absorb_q: one strided-batched cuBLASLt product over the heads (ops/linear.h), q_pe copied
//     beside it; without a cuBLASLt algorithm, per (head, 128 columns of R, 16 tokens) CTA; q_nope of
//     the tokens in shared memory, each thread one column, W_uk read once per CTA (coalesced rows),
//     FP32 sums over dn in the CPU's order, rounded to BF16; q_pe copied through.
//   mla_unabsorb: one strided-batched cuBLASLt product over the heads; without a cuBLASLt algorithm,
//     one warp per output row of W_uv, 8 tokens per CTA from shared memory.
//   The hand-written kernels are the path the engine takes only when cuBLASLt has no algorithm;
//   they stay as that fallback and as the CPU-order reference on the GPU (LinearPath::Kernel,
//   tested by MlaProjCuda.AbsorbAndUnabsorbMatchCpu and timed by the ops bench).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/cuda_device.cuh"
#include "ops/linear.h"
#include "ops/mla.h"

namespace k3::ops::cuda {
namespace {

using bf16raw = __nv_bfloat16;

using detail::warp_sum;

// ---------------------------------------------------------------- absorb
constexpr int kAbsThreads = 128;  // one column of R per thread
constexpr int kAbsTokens = 16;    // tokens per CTA

__global__ void __launch_bounds__(kAbsThreads)
    mla_absorb_q_kernel(const bf16raw* __restrict__ q, const bf16raw* __restrict__ w, bf16raw* __restrict__ q_lat,
                        int64_t T, int H, int dn, int P, int dv, int R) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
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
  detail::pdl_wait();
  detail::pdl_launch_dependents();
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
  detail::pdl_wait();
  detail::pdl_launch_dependents();
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

}  // namespace

int mla_absorb_q(const Context& ctx, const bf16* q, const bf16* w_kvb, bf16* q_lat, int64_t T, int H, int dn, int P,
                 int dv, int R, LinearPath path) {
  if (T < 0 || H <= 0 || dn <= 0 || P < 0 || dv <= 0 || R <= 0 || H > 65535) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const auto stream = reinterpret_cast<cudaStream_t>(ctx.stream);
  const auto* qp = reinterpret_cast<const bf16raw*>(q);
  auto* lp = reinterpret_cast<bf16raw*>(q_lat);
  // Head h: q_lat[:, h, :R] [T, R] = q_nope[:, h] [T, dn] W_uk_h [dn, R].
  if (path != LinearPath::Kernel && path != LinearPath::Rows &&
      linear_batched_cublaslt(ctx, q, int64_t{H} * (dn + P), dn + P, w_kvb, R, int64_t{dn + dv} * R, false, q_lat,
                              int64_t{H} * (R + P), R + P, T, dn, R, H)) {
    if (P == 0) return cudaGetLastError();
    const int64_t n = T * H * P;
    return detail::launch(mla_copy_pe_kernel, static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0,
                          stream, qp, lp, T * H, dn, P, R);
  }
  const int64_t tiles = (T + kAbsTokens - 1) / kAbsTokens;
  if (tiles > 65535) return cudaErrorInvalidValue;
  const size_t smem = sizeof(float) * kAbsTokens * static_cast<size_t>((dn + 3) & ~3);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((R + kAbsThreads - 1) / kAbsThreads), static_cast<unsigned>(H),
                  static_cast<unsigned>(tiles));
  return detail::launch(mla_absorb_q_kernel, grid, kAbsThreads, smem, stream, qp,
                        reinterpret_cast<const bf16raw*>(w_kvb), lp, T, H, dn, P, dv, R);
}

int mla_unabsorb(const Context& ctx, const bf16* o_lat, const bf16* w_kvb, bf16* o, int64_t T, int H, int dn, int dv,
                 int R, LinearPath path) {
  if (T < 0 || H <= 0 || dn <= 0 || dv <= 0 || R <= 0 || H > 65535) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  // Head h: o[:, h] [T, dv] = o_lat[:, h] [T, R] W_uv_h^T (W_uv_h [dv, R]).
  if (path != LinearPath::Kernel && path != LinearPath::Rows &&
      linear_batched_cublaslt(ctx, o_lat, int64_t{H} * R, R, w_kvb + int64_t{dn} * R, R, int64_t{dn + dv} * R, true,
                              o, int64_t{H} * dv, dv, T, R, dv, H))
    return cudaGetLastError();
  const int64_t tiles = (T + kUnTokens - 1) / kUnTokens;
  const size_t smem = sizeof(float) * kUnTokens * static_cast<size_t>(R);
  if (tiles > 65535 || smem > 48 * 1024) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((dv + kUnWarps - 1) / kUnWarps), static_cast<unsigned>(H),
                  static_cast<unsigned>(tiles));
  return detail::launch(mla_unabsorb_kernel, grid, kUnWarps * 32, smem, reinterpret_cast<cudaStream_t>(ctx.stream),
                        reinterpret_cast<const bf16raw*>(o_lat), reinterpret_cast<const bf16raw*>(w_kvb),
                        reinterpret_cast<bf16raw*>(o), T, H, dn, dv, R);
}

}  // namespace k3::ops::cuda
